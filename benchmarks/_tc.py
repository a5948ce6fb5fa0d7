"""torch_checkpointing (Meta, PyPI ``torch-checkpointing``) as a benchmark anchor.

Its own public API only: a :class:`torch_checkpointing.CheckpointManager` whose saves are
staged by a thread of the training process (into shared memory) and written by one writer
process, with the explicit CPU configuration its troubleshooting guide gives (pinned memory
and non-blocking copies only where an accelerator is available). ``save()`` returns before
the state is copied; ``manager.lock()`` (the guard its docs put around ``optimizer.step()``)
waits until the copy is done, so :meth:`Tc.wait_staged` is what a training loop that
mutates the state would wait. Its writer does not fsync: "durable" is the write future
(files written and renamed into place); on tmpfs that is the same as every other system's.

When the package is missing, :func:`missing` says why and the scripts skip the anchor.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

NAME = "torch_checkpointing"


def missing() -> str | None:
    """Why the anchor cannot run here (None: it can)."""
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as err:
        return (f"{NAME} skipped: not importable ({err}); "
                "pip install 'torch-checkpointing==0.1.1'")
    return None


def version() -> str:
    import torch_checkpointing

    return str(torch_checkpointing.__version__)


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (what a save wrote)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Tc:
    """One torch_checkpointing manager: async saves (its default), or sync ones for a
    restore benchmark that only needs the files (no writer process started)."""

    def __init__(self, sync: bool = False) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig

        if sync:
            cfg = CheckpointManager.Config.with_sync_save()
        else:
            accel = torch.accelerator.is_available()
            staging = CheckpointStagerConfig(use_pinned_memory=accel,
                                             use_non_blocking_copy=accel)
            cfg = CheckpointManager.Config(save=AsyncCheckpointSaverConfig(
                staging_config=staging))
        self.manager = CheckpointManager(cfg)

    def prewarm(self, payload: Mapping[str, Any]) -> None:
        """Allocate the staging buffers for ``payload`` before the first save (its
        ``prewarm_staging``; the writer process is started when the manager is made)."""
        self.manager.prewarm_staging(payload)

    def save(self, path: Path, payload: Mapping[str, Any]) -> Future[Any]:
        """Start a save; the future resolves once the checkpoint is written."""
        fut = self.manager.save(str(path), payload)
        if fut is None:  # a sync manager: written already
            done: Future[Any] = Future()
            done.set_result(None)
            return done
        return fut

    def wait_staged(self) -> None:
        """Return once the save in flight has copied the state (the training loop may
        change it again)."""
        with self.manager.lock():
            pass

    def load(self, path: Path, into: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.manager.load(str(path), into=into)

    def writer_pid(self) -> int | None:
        """The writer process's pid (private attributes: the API names no pid)."""
        proc = getattr(getattr(getattr(self.manager, "_saver", None),
                               "_checkpoint_process", None), "process", None)
        if proc is None:
            return None
        pid = proc.processes[0].pid
        return int(pid) if pid is not None else None

    def close(self) -> None:
        self.manager.close()


