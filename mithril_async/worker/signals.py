"""The signals a whole job is sent (SLURM ``scancel``, Kubernetes, Ctrl-C, a closed terminal)
that must not end a checkpoint worker: the trainer starts it with them blocked and the worker
handles them as "is my trainer still alive?" (it ends after its trainer, once it has finished
what it was handed)."""

from __future__ import annotations

import signal

__all__ = ["JOB_SIGNALS"]

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
