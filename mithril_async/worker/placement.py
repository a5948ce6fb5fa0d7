"""Where a manager's saves run: its checkpoint worker, or the training process.

``[checkpointing.pipeline] process = "worker"`` (the default) gives a manager a
:class:`~mithril_async.worker.client.WorkerClient` whose snapshots are staged in shared memory
(:class:`~mithril_async.worker.arena.SharedArena`). What a worker cannot serve (an object
passed to the manager, which it cannot rebuild from the configuration; a platform without
``memfd_create``) runs in the training process instead, and the log says why, when the worker
is only the default; when the configuration itself says ``process = "worker"`` it is a
:class:`~mithril_async.errors.ConfigError` naming it, before anything is started.
"""

from __future__ import annotations

import functools
import logging
import os

from mithril_async.config import Config
from mithril_async.errors import ConfigError
from mithril_async.save.context import SaveContext
from mithril_async.save.staging import StagingArea
from mithril_async.worker.arena import SharedArena
from mithril_async.worker.client import NodeTiers, WorkerClient

__all__ = ["refuse_unserved", "worker_for", "worker_unsupported"]

log = logging.getLogger("mithril_async")


def worker_unsupported(config: Config) -> str | None:
    """Why saves of this configuration cannot run in a worker (None: they can), naming the
    platform feature at fault. (Objects passed to the manager are decided by the manager;
    every key of the configuration is served.)"""
    del config
    if not hasattr(os, "memfd_create"):
        return "this platform has no memfd_create (the staged snapshot's shared memory)"
    return None


def _why_inline(config: Config, given: list[str]) -> str | None:
    return worker_unsupported(config) or (
        f"{' and '.join(given)} was passed to the manager (store= / coordinator= / "
        "retention=)" if given else None)


def refuse_unserved(config: Config, given: list[str]) -> None:
    """:class:`ConfigError` when the configuration itself sets ``process = "worker"`` and
    asks for something a checkpoint worker cannot serve (``given``: the objects passed to the
    manager that a worker cannot rebuild)."""
    if not config.checkpointing.pipeline.worker_required:
        return
    why = _why_inline(config, given)
    if why is not None:
        raise ConfigError(
            f'checkpointing.pipeline.process = "worker" is set, but {why}: a checkpoint '
            'worker cannot serve this; set process = "inline", or leave the key out to '
            "run such saves in the training process")


def worker_for(ctx: SaveContext, given: list[str], *, run_id: str, runs_prefix: str,
               sharded_model: bool, keep_all: bool, tiers: NodeTiers | None
               ) -> WorkerClient | None:
    """The checkpoint worker the saves of ``ctx`` run in (not started yet), staging into its
    shared memory from now on; None: they run in the training process (logged)."""
    if ctx.config.checkpointing.pipeline.process != "worker":
        return None
    why = _why_inline(ctx.config, given)
    if why is not None:
        log.info('process = "worker": saves run in the training process (%s)', why)
        return None
    arena = SharedArena()
    ctx.new_area = functools.partial(StagingArea, alloc=arena.buffer)
    ctx.ring_alloc = arena.buffer  # a streamed save's slots, filled here
    return WorkerClient(ctx, arena, run_id=run_id, runs_prefix=runs_prefix,
                        sharded_model=sharded_model, keep_all=keep_all, tiers=tiers)
