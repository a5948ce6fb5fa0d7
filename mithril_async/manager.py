"""CheckpointManager: ``await save(step)`` blocks only for a snapshot; the rest is background.

The manager owns the lifecycle (a private event loop thread, :class:`BackgroundLoop`; the
codec thread pool; the Store), the public API and the snapshot entry point. Each save is one
:class:`~mithril_async.save.job.SaveJob`: ``save()`` has it copy the state into the
reusable staging buffers on the caller's thread, then runs the rest — encode, checksum, write,
manifest commit, alias moves, retention — on the background loop. What saves share lives in a
:class:`~mithril_async.save.context.SaveContext`, never on the manager. Restores read through
the one :class:`~mithril_async.restore.reader.VersionReader`. At most one save is in flight;
a failure there aborts only that save, leaves the previous version untouched, and is raised by
the next ``save()``/``wait_until_finished()``/``check_for_errors()``.

Synchronous training loops use the same machinery through ``save_nowait()``, ``wait()``,
``restore_sync()`` and ``close()``; the pipeline progresses on its own thread either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from mithril_async.catalog import RunCatalog
from mithril_async.catalog.start_up import maintain_run
from mithril_async.config import CheckpointingConfig, Config, load_config, with_absolute_paths
from mithril_async.current_run import agree_run_id
from mithril_async.distributed import DistCoordinator, dist_world
from mithril_async.errors import ConfigError, SaveFailed
from mithril_async.layout import RunLayout
from mithril_async.lifetime import Owned
from mithril_async.listeners import Listener, ResultListeners
from mithril_async.live import LiveState
from mithril_async.pipeline.loop import BackgroundLoop, lower_priority
from mithril_async.pipeline.pool import CodecPool
from mithril_async.preemption import Preemption
from mithril_async.restore.apply import (  # noqa: F401  (ResumeReport: re-exported)
    LiveRestore,
    OnReshard,
    RestoreResult,
    ResumeReport,
)
from mithril_async.restore.reader import VersionReader
from mithril_async.retention import Policy, from_config
from mithril_async.run_store import open_run_store
from mithril_async.save.context import SaveContext
from mithril_async.save.coordinator import Coordinator, LocalCoordinator
from mithril_async.save.results import SaveHandle, SaveResult
from mithril_async.save.sequence import SaveSequence
from mithril_async.save.waiting import run_awaiting, run_blocking
from mithril_async.state import default_on_reshard
from mithril_async.storage.base import Store
from mithril_async.tiers.layer import TierLayer
from mithril_async.worker.placement import refuse_unserved, worker_for

log = logging.getLogger("mithril_async")
_UNSET: Any = object()  # retention= not given: the config decides


def _unbuildable(store: Store | None, coordinator: Coordinator | None, retention: Any
                 ) -> list[str]:
    """The objects passed to a manager that a checkpoint worker cannot rebuild."""
    own = None if isinstance(coordinator, LocalCoordinator) else coordinator
    return [what for what, obj in (("a store", store), ("a coordinator", own),
                                   ("a retention policy", retention))
            if obj is not None and obj is not _UNSET]


def _coordinator(given: Coordinator | None, cfg: CheckpointingConfig) -> Coordinator:
    """``given``, or torch.distributed's gloo group with several ranks (one rank: local).
    ``on_busy`` other than "wait" is refused with several ranks: skip and error are decided
    per rank, and the ranks would disagree on which saves happen."""
    if given is None:
        world = dist_world()
        given = DistCoordinator() if world is not None and world[1] > 1 else LocalCoordinator()
    if given.world_size > 1 and cfg.pipeline.on_busy != "wait":
        raise ConfigError(f"pipeline.on_busy = {cfg.pipeline.on_busy!r} is not "
                          "supported with several ranks; use 'wait'")
    return given


class CheckpointManager:
    """Background checkpointing of a dict of stateful objects (model, optimizer, ...).

    ``retention``: a :class:`~mithril_async.retention.Policy` deciding which versions survive
    each commit (None keeps everything); left out, the config's ``keep_*`` options decide.

    ``on_result``: called with every save's :class:`SaveResult` (committed, failed or skipped)
    on a thread of its own, never the caller's (:mod:`~mithril_async.listeners`); more with
    :meth:`add_listener`. ``on_save``: committed results only, on the background loop
    before the save's handle resolves (to see or annotate a result first).

    With ``[checkpointing.tiers]`` it saves and restores through the tiers (``self.tiers``,
    :mod:`mithril_async.tiers.layer`); ``tier_remote``: the remote tier's store instead of
    opening ``[checkpointing.remote]`` (tests pass an in-memory one).
    """

    def __init__(
        self,
        config: Config | CheckpointingConfig,
        state: Mapping[str, Any],
        *,
        store: Store | None = None,
        runs_prefix: str | None = None,
        on_save: Callable[[SaveResult], None] | None = None,
        on_result: Listener | None = None,
        coordinator: Coordinator | None = None,
        sharded_model: bool = False,
        retention: Policy | None = _UNSET,
        tier_remote: Store | None = None,
    ) -> None:
        # relative local paths resolve here, once: a later chdir moves no save (nor the worker's)
        self.config = with_absolute_paths(
            config if isinstance(config, Config) else Config(checkpointing=config))
        self.cfg = cfg = self.config.checkpointing
        #: the items saved and restored, each bound to how (plain entries written back there)
        self.state = LiveState(state)
        given = _unbuildable(store, coordinator, retention)
        refuse_unserved(self.config, given)  # before anything is started
        #: the tiers this manager saves and restores through ([checkpointing.tiers]; None: off)
        self.tiers = TierLayer.of(self.config, remote=tier_remote)
        if self.tiers is not None:  # this node's folder, the tier commit, retention per tier
            self.config, store, runs_prefix, coordinator, on_save = self.tiers.parts(
                store, runs_prefix, coordinator, on_save)
            self.cfg = cfg = self.config.checkpointing
            retention = None if retention is _UNSET else retention
        keep_all = retention is None  # a worker keeps every version too (tiers: their own)
        self.coordinator: Coordinator = _coordinator(coordinator, cfg)
        self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        if store is None:
            store, prefix = open_run_store(cfg)
            runs_prefix = runs_prefix or prefix
        self.store: Store = store
        #: continued_run: this manager continues the runs folder's current run (no run_id)
        self.run_id, self.continued_run = agree_run_id(
            cfg, self.store, runs_prefix or "runs", self.coordinator)
        self.layout = RunLayout(runs_prefix or "runs", self.run_id)
        self.catalog = RunCatalog(self.store, self.layout,
                                  claim_stale_s=cfg.pipeline.claim_stale_s)
        #: who hears of each save's result (listeners, the inline on_save hook)
        self._results = ResultListeners(on_result, on_save)
        self._pool = CodecPool(cfg.compression.threads or max(1, os.cpu_count() or 1),
                               "mithril-codec", initializer=lower_priority,
                               initargs=(cfg.pipeline.background_nice,))
        #: what every save shares; each save itself is a SaveJob
        self._ctx = SaveContext.for_run(
            self.config, self.state, self.store, self.layout, self.catalog, self.coordinator,
            self._pool, retention=from_config(cfg) if retention is _UNSET else retention,
            sharded_model=sharded_model, on_save=self._results.inline)
        #: what outlives this manager unless released, and its release if it is collected
        self._owned, self._release = Owned.watching(self, self._pool, self._results)
        self._worker = worker_for(self._ctx, given, run_id=self.run_id,
                                  runs_prefix=runs_prefix or "runs",
                                  sharded_model=sharded_model, keep_all=keep_all,
                                  tiers=self.tiers)
        self.process = "inline" if self._worker is None else "worker"  #: where saves run
        self.sharded_model = sharded_model  #: each rank saves its own model shard
        #: the saves, one at a time, from the caller's thread to their handles
        self.saves = SaveSequence(self._ctx, self.state, self._results, self._worker,
                                  lambda: self.loop, continued_run=self.continued_run)
        #: restores into the live state (read through the one reader, then applied)
        self.restorer = LiveRestore(
            self.state, cfg, VersionReader(self.catalog, pool=self._pool,
                                           inflight_mib=cfg.pipeline.max_inflight_mib),
            self.layout, rank=self.rank, world_size=self.world_size, saves=self._ctx,
            guard=lambda: self.saves.guard, worker=self._worker)
        self._loop: BackgroundLoop | None = None
        #: closed; whether the start's writing part (cleanup, alias repairs) ran (_start)
        self._closed = self._maintained = False
        if self.tiers is not None:  # collective: saves are numbered above every tier's folders
            self.tiers.attach(self.restorer)
        #: save_on_signals: signal handlers and what follows a signal (late: process-wide)
        self.preemption = self.saves.preemption = Preemption.from_config(
            cfg, self.coordinator, self._results)
        if self._worker is not None:  # last, as nothing after it can fail: ready by the
            self._owned.worker = self._worker  # first save (started in the background)
            self._worker.start()

    @property
    def worker_pid(self) -> int | None:
        """The checkpoint worker's process id (``process = "worker"``, once started)."""
        return None if self._worker is None else self._worker.pid

    def worker_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) for the checkpoint
        worker to finish its start-up; whether it has. A save made once it is ready returns
        only after it is handed over (it then survives this process's death). False when
        saves run inline, or the worker failed to start (the next save says why)."""
        return self._worker is not None and self._worker.wait_ready(timeout)

    @classmethod
    def from_toml(cls, path: str | Path, state: Mapping[str, Any], **kw: Any) -> CheckpointManager:
        return cls(load_config(path), state, **kw)

    @property
    def history(self) -> list[SaveResult]:
        """Every save's result, in order (skipped and failed ones included)."""
        return self._ctx.history

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(result)`` with the result of every save that ends from now on (see
        ``on_result``); an exception in it is logged, never fails a save."""
        self._results.add(fn)

    def remove_listener(self, fn: Listener) -> None:
        self._results.remove(fn)

    @property
    def preempted(self) -> bool:
        """A save asked for by a signal ended (``exit_after_signal_save = false``): stop."""
        return self.preemption is not None and self.preemption.preempted

    @property
    def retention(self) -> Policy | None:
        """The policy applied after each commit (None: every version is kept)."""
        return self._ctx.retention

    # ------------------------------------------------------------ lifecycle
    @property
    def loop(self) -> BackgroundLoop:
        """The background loop, started (with the start-up maintenance) on first use."""
        return self._started(maintain=True)

    def _started(self, *, maintain: bool) -> BackgroundLoop:
        """Start the loop if needed; with ``maintain`` also the start's writing part.

        Restores and queries start read-only (``maintain=False``): a process that only
        reads a run (an evaluation job) never deletes or aborts anything in it and writes no
        alias; the maintenance then runs at its first save, or on entering ``with``."""
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        if self._loop is None:
            self._loop = self._owned.loop = BackgroundLoop(
                nice=self.cfg.pipeline.background_nice)
            self._loop.run(self._start(maintain, first=True))
        elif maintain and not self._maintained:
            self._loop.run(self._start(maintain, first=False))
        return self._loop

    async def _start(self, maintain: bool, *, first: bool) -> None:
        """The run's committed steps (at the first start) and, with ``maintain``, the start's
        writing part once: rank 0 removes what unfinished saves of gone writers left, creates
        the pending ``best`` alias and finishes a killed writer's alias moves
        (:func:`~mithril_async.catalog.start_up.maintain_run`; no barrier: other ranks write
        only into versions rank 0 claimed, and it claims only after this has finished)."""
        if maintain and not self._maintained:
            self._maintained = True
            if self.rank == 0:
                await maintain_run(self.catalog, self.cfg, (self._ctx.root_local(),
                                                            self._ctx.root_remote()))
        if first:
            self._ctx.steps = await self.catalog.committed_steps()

    def _bg(self, coro: Any) -> Any:
        """Run ``coro`` on the background loop, blocking the calling thread (a read: the
        loop starts read-only if this is its first use)."""
        return self._started(maintain=False).run(coro)

    async def __aenter__(self) -> CheckpointManager:
        _ = self.loop
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if et is None:
                await self.wait_until_finished()
        finally:
            self._close(wait=False, report=et is None)

    def __enter__(self) -> CheckpointManager:
        _ = self.loop
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if et is None:
                self.wait()
        finally:
            self._close(wait=False, report=et is None)

    def close(self, wait: bool = True) -> None:
        """Finish (or with ``wait=False`` abandon) the in-flight save and release resources.

        Raises :class:`SaveFailed` (after releasing everything) when the last save failed
        and no earlier call reported it (its ``handle.result()``, ``wait()``,
        ``check_for_errors()``, the next ``save()``): a failure must never end up only in
        the log."""
        self._close(wait, report=True)

    def _close(self, wait: bool, *, report: bool) -> None:
        """``report=False`` (an exception is already propagating out of ``with``): a save
        failure nobody has seen is logged instead of replacing that exception."""
        if self._closed:
            return
        unseen: BaseException | None = None
        exported: BaseException | None = None
        try:
            if wait and self.saves.inflight is not None:
                concurrent.futures.wait([self.saves.inflight])
            if report and self.cfg.export_hf_on_close:  # the export's error is raised below
                from mithril_async.export.hf import export_on_close

                exported = export_on_close(self.cfg, self.catalog, self._bg, self.rank, any(
                    r.status == "committed" for r in self.history), self._pool)
        finally:
            handle, fut = self.saves.handle, self.saves.inflight
            if fut is None or fut.done():  # an abandoned save (wait=False) is no failure
                unseen = self.saves.take_error()
            if handle is not None and handle.error_seen:
                unseen = None  # handle.result() raised it to the caller
            self._closed = True
            if self.saves.guard is not None:
                self.saves.guard.remove()
            self._release.detach()
            if self._worker is not None:  # after the last save: the worker exits
                self._worker.close(wait=wait)
                self._worker.arena.close()
            if self.tiers is not None:  # its replication, uploads and write-backs end first
                self.tiers.close()
            if self._loop is not None:
                self._loop.run(self.store.close())
                self._loop.close()
            self._pool.shutdown(wait=True)
            self.coordinator.close()
            for chain in self._ctx.chains.values():
                chain.release()
            self._results.close()  # every result delivered, before a signal takes effect
            if self.preemption is not None:
                self.preemption.close()
        if unseen is not None:
            if report:
                raise SaveFailed(f"a background save failed: {unseen}") from unseen
            log.error("a background save failed (not raised: another exception is "
                      "propagating): %r", unseen)
        if exported is not None:
            raise exported

    # ------------------------------------------------------------ queries
    def should_save(self, step: int) -> bool:
        """Whether to save ``step``: every ``ckpting_save_iter`` steps, and at the next call
        after a signal of ``save_on_signals`` (with several ranks: call it at every step on
        every rank, where they agree on the step a signal is saved at)."""
        signalled = self.preemption is not None and self.preemption.due(step)
        return signalled or (step > 0 and step % self.cfg.ckpting_save_iter == 0)

    def all_steps(self) -> list[int]:
        return [m.step for m in self._bg(self.catalog.versions(skip_damaged=True))]

    def latest_step(self) -> int | None:
        alias = self._bg(self.catalog.read_alias("latest"))
        return None if alias is None else alias.step

    def best_step(self) -> int | None:
        alias = self._bg(self.catalog.read_alias("best"))
        return None if alias is None or alias.status != "ok" else alias.step

    def check_for_errors(self) -> None:
        """Raise the error of a failed background save (once), as :class:`SaveFailed`.

        A save the caller cancelled (``handle.future.cancel()``, a timeout around it) is not
        an error: it published nothing, and the manager goes on."""
        self.saves.check_for_errors()

    # ------------------------------------------------------------ save
    async def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> SaveHandle:
        """Snapshot now, write in the background; returns once the snapshot is consistent."""
        return await run_awaiting(self.saves.steps(step, metrics, time.perf_counter()))

    def save_nowait(self, step: int, metrics: Mapping[str, Any] | None = None) -> SaveHandle:
        """Synchronous ``save()``: blocks only for the snapshot (and a busy pipeline)."""
        return run_blocking(self.saves.steps(step, metrics, time.perf_counter()))

    async def wait_until_finished(self) -> None:
        """Wait for the in-flight save (and the worker's answer for one cancelled) and its
        listeners; raise :class:`SaveFailed` if it failed."""
        await self.saves.finished()

    def wait(self) -> None:
        """Synchronous :meth:`wait_until_finished`."""
        self.saves.finished_sync()

    # ------------------------------------------------------------ restore
    async def restore(self, target: str | int = "latest", *, fallback: bool = False,
                      load: Literal["all", "model"] = "all",
                      on_reshard: OnReshard = default_on_reshard,
                      verify: Literal["block", "whole"] | None = None) -> RestoreResult:
        """Load a committed version into the live state; return its step (a
        :class:`RestoreResult`: an int that also says ``resume.exact``).

        ``fallback=True``: if the target fails verification, the newest older version that
        verifies is loaded instead (and a warning names what was skipped).

        A version whose sharded state (``ShardedModel`` / ``ShardedOptimizer``) recorded its
        pieces restores on any world size and mesh: each rank reads the pieces overlapping
        its own shards, straight into the live tensors. What cannot be remapped is said, not
        guessed: ``result.resume.exact`` is False; the RNG of a rank that existed at the save
        is restored, a new rank is reseeded deterministically (``state.reseed_rng``); each
        data-loader state (``get_state``) is ``on_reshard(states_by_rank, new_rank,
        new_world)`` (default: :func:`~mithril_async.state.default_on_reshard`).

        ``verify`` (None: ``[checkpointing.restore] verify``, default ``"block"``): how what
        is decoded into the live tensors is verified. ``"block"``: one read, every block
        verified before it is written; damage found after the first write raises
        :class:`~mithril_async.errors.RestoreIncomplete` (partially overwritten), or with
        ``fallback=True`` restores the newest older version that verifies over all of it.
        ``"whole"``: every blob verified whole first, so damage leaves the live state
        untouched (a second read of every byte; over S3, fresh tensors: memory = the state).
        """
        if self.tiers is not None:  # the tiers' recovery blocks on collectives: off this loop
            return await asyncio.to_thread(self.restore_sync, target, fallback=fallback,
                                           load=load, on_reshard=on_reshard, verify=verify)
        loop = self._started(maintain=False)
        decoded = await asyncio.wrap_future(loop.submit(self.restorer.read(target, fallback,
                                                                           load, verify)))
        return self.restorer.apply(decoded, load, on_reshard)

    def restore_sync(self, target: str | int = "latest", *, fallback: bool = False,
                     load: Literal["all", "model"] = "all",
                     on_reshard: OnReshard = default_on_reshard,
                     verify: Literal["block", "whole"] | None = None) -> RestoreResult:
        if load == "model" and "model" not in self.state:
            raise ConfigError('restore(load="model") loads the state\'s "model" entry, and '
                              f"this manager's state has none (it has: {', '.join(self.state)})")
        if self.tiers is not None:  # each file from the fastest tier holding it, then read
            return self.tiers.restore(target, load, fallback, lambda vid: self.restorer.apply(
                self._bg(self.restorer.read(vid, False, load, verify)), load, on_reshard))
        decoded = self._bg(self.restorer.read(target, fallback, load, verify))
        return self.restorer.apply(decoded, load, on_reshard)
