"""CheckpointManager: ``await save(step)`` blocks only for a snapshot; the rest is background.

The manager owns a private event loop thread (:class:`BackgroundLoop`), a thread pool for the
codec, reusable staging buffers and a Store. ``save()`` copies the state into the staging
buffers on the caller's thread and hands everything else — encode, checksum, write, manifest
commit, alias moves, retention — to the background loop. At most one save is in flight; a
failure there aborts only that save, leaves the previous version untouched, and is raised by the
next ``save()``/``wait_until_finished()``/``check_for_errors()``.

Synchronous training loops use the same machinery through ``save_nowait()``, ``wait()``,
``restore_sync()`` and ``close()``; the pipeline progresses on its own thread either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.config import CheckpointingConfig, Config, load_config
from mithril_async.delta.chain import ChainPolicy, ItemChain, commit_item, plan_item
from mithril_async.distributed import DistCoordinator, dist_world
from mithril_async.errors import (
    ChecksumMismatch,
    ConfigError,
    DistributedError,
    InvalidFormat,
    KeyNotFound,
    MissingPrevious,
    SaveFailed,
    SaveInProgress,
    StepAlreadyExists,
    VersionNotFound,
)
from mithril_async.layout import RunLayout, new_run_id
from mithril_async.manifest import (
    BaseRef,
    BlobRef,
    OptimizerEntry,
    RankKey,
    ResumeInfo,
    RngEntry,
    SaveStats,
    ShardRef,
    VersionManifest,
    dump_model,
    utcnow,
    version_id,
    version_number,
)
from mithril_async.pipeline.bases import BaseLoader
from mithril_async.pipeline.blobs import BlobCodec, EncodePlan, StagedItem
from mithril_async.pipeline.coordinator import Coordinator, LocalCoordinator, Outcome, RankPart
from mithril_async.pipeline.loop import BackgroundLoop, all_or_first_error, lower_priority
from mithril_async.pipeline.lossy import (
    LossyTrack,
    Roles,
    lossy_roles,
    merge_lossy,
    read_lossy_chain,
    write_lossy,
)
from mithril_async.pipeline.overlap import OverlapCopy, StepGuard, optimizers_in
from mithril_async.pipeline.results import SaveHandle, SaveResult
from mithril_async.pipeline.stager import Snapshot
from mithril_async.retention import KeepBestN, KeepEveryNSteps, KeepLastN, Policy, plan_retention
from mithril_async.state import (
    JsonStateful,
    Stateful,
    capture_rng,
    flatten_state,
    restore_rng,
    unflatten_state,
)
from mithril_async.storage import open_store
from mithril_async.storage.base import Store
from mithril_async.storage.local import LocalStore
from mithril_async.storage.mirror import MirrorStore

log = logging.getLogger("mithril_async")
R = TypeVar("R")
#: chain bookkeeping applied after a commit: chain, buffer set, blob, plan, hashes, names
_ChainUpdate = tuple[ItemChain, int, BlobRef, EncodePlan, dict[str, int], list[str]]

_RESTORE_ERRORS = (ChecksumMismatch, InvalidFormat, KeyNotFound, MissingPrevious)


def _open_local(cfg: CheckpointingConfig) -> tuple[Store, str]:
    runs = Path(cfg.runs_path).expanduser().absolute()
    runs.mkdir(parents=True, exist_ok=True)
    return LocalStore(runs.parent), runs.name


def open_run_store(cfg: CheckpointingConfig) -> tuple[Store, str]:
    """The store a config asks for, and the runs folder's key prefix.

    No ``[checkpointing.remote]``: local disk. ``mode = "mirror"``: local disk and the bucket
    (:class:`MirrorStore`). ``mode = "remote_only"``: the bucket alone. Keys are the same
    everywhere: ``<runs folder name>/<run_id>/...`` (under the bucket prefix on S3).
    """
    if cfg.remote is None:
        return _open_local(cfg)
    remote = open_store(cfg.remote)
    if cfg.remote.mode == "remote_only":
        return remote, Path(cfg.runs_path).name or "runs"
    local, prefix = _open_local(cfg)
    return MirrorStore(local, remote), prefix


class CheckpointManager:
    """Background checkpointing of a dict of stateful objects (model, optimizer, ...)."""

    def __init__(
        self,
        config: Config | CheckpointingConfig,
        state: Mapping[str, Any],
        *,
        store: Store | None = None,
        runs_prefix: str | None = None,
        on_save: Callable[[SaveResult], None] | None = None,
        coordinator: Coordinator | None = None,
        sharded_model: bool = False,
    ) -> None:
        self.config = config if isinstance(config, Config) else Config(checkpointing=config)
        self.cfg = self.config.checkpointing
        if "model" not in state:
            raise ValueError("state must contain a 'model' entry (anything with state_dict())")
        for name, obj in state.items():
            if not isinstance(obj, (Stateful, JsonStateful)):
                raise TypeError(f"state[{name!r}] has neither state_dict()/load_state_dict() "
                                "nor get_state()/set_state()")
        self.state = dict(state)
        if coordinator is None:  # torch.distributed with >1 rank: coordinate over gloo
            world = dist_world()
            coordinator = (DistCoordinator() if world is not None and world[1] > 1
                           else LocalCoordinator())
        self.coordinator: Coordinator = coordinator
        self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        if self.world_size > 1 and self.cfg.pipeline.on_busy != "wait":
            # skip/error are decided per rank: ranks would disagree on which saves happen
            raise ConfigError(f"pipeline.on_busy = {self.cfg.pipeline.on_busy!r} is not "
                              "supported with several ranks; use 'wait'")
        #: each rank saves its own model shard (FSDP/DTensor) instead of rank 0 the whole model
        self.sharded_model = sharded_model
        if store is None:
            store, prefix = open_run_store(self.cfg)
            runs_prefix = runs_prefix or prefix
        self.store: Store = store
        self.run_id = self.cfg.run_id or new_run_id()
        if self.cfg.run_id is None and isinstance(self.coordinator, DistCoordinator):
            self.run_id = self.coordinator.broadcast_from_zero(self.run_id, "agree_run_id")
        self.layout = RunLayout(runs_prefix or "runs", self.run_id)
        self.catalog = RunCatalog(self.store, self.layout)
        self.on_save = on_save
        self.history: list[SaveResult] = []
        threads = self.cfg.compression.threads or max(1, os.cpu_count() or 1)
        nice = self.cfg.pipeline.background_nice
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, "mithril-codec", initializer=lower_priority, initargs=(nice,))
        self._codec = BlobCodec(self.cfg.compression, self.cfg.pipeline, self._pool)
        comp = self.cfg.compression
        self.chain_policy = ChainPolicy(
            delta=comp.delta and comp.enabled,
            dedup=(comp.delta if comp.dedup is None else comp.dedup) and comp.enabled,
            keyframe_interval=comp.keyframe_interval, delta_base=comp.delta_base,
            min_gain=comp.effective_delta_min_gain, byte_grouping=comp.byte_grouping)
        self._chains: dict[str, ItemChain] = {}
        #: the opt-in lossy tier ([checkpointing.lossy]); None keeps the lossless path as is
        self._lossy = LossyTrack(self.cfg.lossy) if self.cfg.lossy.enabled else None
        self._roles: Roles = {}
        self._lossy_idle_warned = False
        self._loop: BackgroundLoop | None = None
        self._inflight: concurrent.futures.Future[SaveResult] | None = None
        self._error: BaseException | None = None
        self._steps: set[int] | None = None
        self._config_written = False
        self._commit_error: Exception | None = None
        self._closed = False
        #: snapshot = "overlapped": hooks on the state's optimizers, made at the first save
        self._guard: StepGuard | None = None
        self._overlap: OverlapCopy | None = None  # started by _snapshot, taken by _submit

    @classmethod
    def from_toml(cls, path: str | Path, state: Mapping[str, Any], **kw: Any) -> CheckpointManager:
        return cls(load_config(path), state, **kw)

    # ------------------------------------------------------------ lifecycle
    @property
    def loop(self) -> BackgroundLoop:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        if self._loop is None:
            self._loop = BackgroundLoop(nice=self.cfg.pipeline.background_nice)
            self._loop.run(self._start())
        return self._loop

    async def _start(self) -> None:
        # Only rank 0 cleans and creates aliases. No barrier is needed: other ranks write only
        # into versions that rank 0 claimed, and it claims only after this start has finished.
        if self.rank == 0:
            removed = await self.catalog.clean_unfinished(
            orphan_age_s=self.cfg.pipeline.orphan_age_s)
            if removed:
                log.warning("removed leftovers of unfinished saves: %s", ", ".join(removed))
            try:
                await self.catalog.ensure_best_pending(self.cfg.best_metric_name,
                                                       self.cfg.best_mode)
                # a writer killed between its manifest and its alias moves: finish them now
                if await self.catalog.repair_aliases(self.cfg.best_metric_name,
                                                     self.cfg.best_mode):
                    log.warning("moved aliases to committed versions a killed writer left")
                    await self.catalog.update_run_manifest(self._root_local(),
                                                           self._root_remote())
            except InvalidFormat as err:  # a damaged alias must not stop the manager
                log.warning("could not check the aliases of run %s: %s", self.run_id, err)
        self._steps = {m.step for m in await self.catalog.versions(skip_damaged=True)}

    def _bg(self, coro: Any) -> Any:
        """Run ``coro`` on the background loop, blocking the calling thread."""
        return self.loop.run(coro)

    async def __aenter__(self) -> CheckpointManager:
        _ = self.loop
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if et is None:
                await self.wait_until_finished()
        finally:
            self.close(wait=False)

    def __enter__(self) -> CheckpointManager:
        _ = self.loop
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if et is None:
                self.wait()
        finally:
            self.close(wait=False)

    def close(self, wait: bool = True) -> None:
        """Finish (or with ``wait=False`` abandon) the in-flight save and release resources."""
        if self._closed:
            return
        try:
            if wait and self._inflight is not None:
                concurrent.futures.wait([self._inflight])
        finally:
            self._closed = True
            if self._guard is not None:
                self._guard.remove()
            if self._loop is not None:
                self._loop.run(self.store.close())
                self._loop.close()
            self._pool.shutdown(wait=True)
            self.coordinator.close()
            for chain in self._chains.values():
                chain.release()

    # ------------------------------------------------------------ queries
    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.cfg.ckpting_save_iter == 0

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
        fut = self._inflight
        if fut is not None and fut.done():
            self._inflight = None
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None:
                self._error = exc
        if self._error is not None:
            err, self._error = self._error, None
            raise SaveFailed(f"a background save failed: {err}") from err

    # ------------------------------------------------------------ save
    async def save(self, step: int, metrics: Mapping[str, Any] | None = None,
                   *, force: bool = False) -> SaveHandle:
        """Snapshot now, write in the background; returns once the snapshot is consistent."""
        t0 = time.perf_counter()
        handle = self._begin(step, t0)
        if handle is not None:
            return handle
        fut = self._inflight
        waited = 0.0
        if fut is not None and not fut.done():
            if self.cfg.pipeline.on_busy == "wait":
                log.info("save of step %d waits for the previous save (on_busy=wait)", step)
                await asyncio.wrap_future(fut)
                waited = time.perf_counter() - t0
            else:
                return self._busy(step, t0)
        self.check_for_errors()
        snaps = self._snapshot(step)
        for snap in snaps.values():
            if isinstance(snap, Snapshot):
                await snap.wait()
        return self._submit(step, metrics, snaps, t0, waited)

    def save_nowait(self, step: int, metrics: Mapping[str, Any] | None = None) -> SaveHandle:
        """Synchronous ``save()``: blocks only for the snapshot (and a busy pipeline)."""
        t0 = time.perf_counter()
        handle = self._begin(step, t0)
        if handle is not None:
            return handle
        fut = self._inflight
        waited = 0.0
        if fut is not None and not fut.done():
            if self.cfg.pipeline.on_busy == "wait":
                log.info("save of step %d waits for the previous save (on_busy=wait)", step)
                concurrent.futures.wait([fut])
                waited = time.perf_counter() - t0
            else:
                return self._busy(step, t0)
        self.check_for_errors()
        snaps = self._snapshot(step)
        for snap in snaps.values():
            if isinstance(snap, Snapshot):
                snap.wait_blocking()
        return self._submit(step, metrics, snaps, t0, waited)

    def _begin(self, step: int, t0: float) -> SaveHandle | None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        _ = self.loop
        self.check_for_errors()
        if self._steps is not None and step in self._steps:
            raise StepAlreadyExists(f"run {self.run_id}: step {step} is already committed; "
                                    "nothing is overwritten")
        return None

    def _busy(self, step: int, t0: float) -> SaveHandle:
        if self.cfg.pipeline.on_busy == "error":
            raise SaveInProgress(f"save of step {step} refused: a save is still in flight")
        res = SaveResult(step, status="skipped", stall_s=time.perf_counter() - t0)
        log.info("save of step %d skipped: previous save still in flight (on_busy=skip)", step)
        self.history.append(res)
        return SaveHandle(res)

    def _snapshot(self, step: int) -> dict[str, Snapshot | dict[str, Any]]:
        """Copy every stateful object's tensors into reused buffers (the stall)."""
        out: dict[str, Snapshot | dict[str, Any]] = {}
        skeletons: dict[str, Any] = {}
        self._areas: dict[str, int] = {}
        defer = self._deferrable()
        for name, obj in self.state.items():
            if isinstance(obj, Stateful):
                skeleton, tensors = flatten_state(obj.state_dict())
                chain = self._chains.get(name)
                if chain is None:  # once per item: its staging buffers live in the chain
                    chain = self._chains[name] = ItemChain(self.chain_policy)
                self._areas[name] = chain.write_idx
                out[name] = chain.areas[chain.write_idx].snapshot(tensors, defer)
                skeletons[name] = skeleton
            else:
                out[name] = {"json_state": obj.get_state()}
        self._skeletons = skeletons
        self._roles = lossy_roles(self.state) if self._lossy is not None else {}
        out["__rng__"] = {"rng": capture_rng()}
        self._overlap = self._start_overlap(out)
        return out

    def _deferrable(self) -> frozenset[int]:
        """Addresses of the tensors an overlapped snapshot may copy after ``save()`` returns
        (none with snapshot = "blocking"); waits for any copy still running first."""
        if self.cfg.pipeline.snapshot != "overlapped":
            return frozenset()
        if self._guard is None:
            self._guard = StepGuard(optimizers_in(self.state))
            if not self._guard.optimizers:
                log.warning('snapshot = "overlapped": no optimizer in the state, so nothing '
                            "is guarded and every tensor is copied before save() returns")
        self._guard.wait()
        return self._guard.pointers()

    def _start_overlap(self, snaps: Mapping[str, Snapshot | dict[str, Any]]
                       ) -> OverlapCopy | None:
        """Start the background copy of every item's deferred tensors (one thread job)."""
        if self._guard is None:
            return None
        staged = [s for s in snaps.values() if isinstance(s, Snapshot)]
        if not any(s.deferred or s.later_event is not None for s in staged):
            return None
        now = [s.event for s in staged if s.event is not None]
        for s in staged:  # the device copies are awaited by the pipeline, not by save()
            s.event = None
        copy = OverlapCopy([j for s in staged for j in s.deferred],
                           [w for s in staged for w in s.watch], self._guard.copy_threads,
                           events_now=now,
                           events_later=[s.later_event for s in staged
                                         if s.later_event is not None],
                           device_watch=[w for s in staged for w in s.later_watch])
        self._guard.pending = copy
        return copy

    def _submit(self, step: int, metrics: Mapping[str, Any] | None,
                snaps: dict[str, Snapshot | dict[str, Any]], t0: float,
                waited: float) -> SaveHandle:
        res = SaveResult(step, stall_s=time.perf_counter() - t0, waited_s=waited)
        overlap, self._overlap = self._overlap, None
        if overlap is not None:
            overlap.result = res
        items = [StagedItem(name, self._skeletons[name], snap.tensors, self._areas[name])
                 for name, snap in snaps.items() if isinstance(snap, Snapshot)]
        json_states = {name: s["json_state"] for name, s in snaps.items()
                       if isinstance(s, dict) and "json_state" in s}
        rng = snaps["__rng__"]
        assert isinstance(rng, dict)
        job = self._run_save(res, dict(metrics or {}), items, json_states, rng["rng"], t0,
                             self._roles, overlap)
        fut = self.loop.submit(job)
        self._inflight = fut
        return SaveHandle(res, fut)

    async def _run_save(self, res: SaveResult, metrics: dict[str, Any], items: list[StagedItem],
                        json_states: dict[str, Any], rng: dict[str, Any], t0: float,
                        roles: Roles, overlap: OverlapCopy | None = None) -> SaveResult:
        """One save; a lossy version that did not commit never becomes the next base."""
        try:
            return await self._run_save_inner(res, metrics, items, json_states, rng, t0, roles,
                                              overlap)
        finally:
            if self._lossy is not None:
                self._lossy.rollback()  # no-op once the version committed

    async def _run_save_inner(self, res: SaveResult, metrics: dict[str, Any],
                              items: list[StagedItem], json_states: dict[str, Any],
                              rng: dict[str, Any], t0: float, roles: Roles,
                              overlap: OverlapCopy | None) -> SaveResult:
        coord = self.coordinator
        # The version number is agreed (rank 0 claims it, then a broadcast) while this rank
        # already encodes: blob writers hold their first bytes until the number is known.
        agree = asyncio.ensure_future(coord.agree_version(self.catalog.claim_version))
        updates: list[_ChainUpdate] = []
        try:
            if overlap is not None:  # the staged buffers are complete (and untorn) first
                await overlap.finished()
            part = await self._write_part(agree, res, items, json_states, rng, updates, roles)
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError):
                if not agree.done():
                    agree.cancel()
                elif not agree.cancelled() and agree.exception() is None:
                    await asyncio.shield(self._discard(agree.result()))
                raise
            part = RankPart(rank=self.rank, error=f"{type(err).__name__}: {err}")
            local_err: BaseException | None = err
        else:
            local_err = None
        # every rank takes part in the agreement; its failure fails the save as before
        number = await agree
        res.version_id = version_id(number)
        try:
            parts = await coord.gather_parts(part)
        except DistributedError:  # a peer died or hung before any commit: drop our blobs
            await asyncio.shield(self._discard(number))
            raise
        outcome: Outcome | None = None
        manifest: VersionManifest | None = None
        if parts is not None:  # rank 0 decides
            try:
                outcome, manifest = await self._commit(number, res, metrics, parts)
            except asyncio.CancelledError:  # cancelled while committing: publish nothing
                await asyncio.shield(self._discard(number))
                raise
        outcome = await coord.broadcast_outcome(outcome)
        if not outcome.committed:
            res.status, res.error = "failed", outcome.error
            res.total_s = time.perf_counter() - t0
            self.history.append(res)
            log.error("save of step %d (%s) failed: %s", res.step, res.version_id, outcome.error)
            await asyncio.shield(self._discard(number))
            local_err = local_err or self._commit_error
            self._commit_error = None
            if local_err is not None and coord.world_size == 1:
                raise local_err
            raise DistributedError(outcome.error or "save failed")
        if self._steps is not None:
            self._steps.add(res.step)
        for chain, idx, ref, plan, hashes, names in updates:
            commit_item(chain, idx, version_id(number), ref, plan, hashes, names)
        if self._lossy is not None and part.lossy is not None:
            mine = part.lossy.shards[0]
            self._lossy.commit(BaseRef(version_id=version_id(number), key=mine.key,
                                       xxh64=mine.xxh64))
        if manifest is not None:
            await self._after_commit(manifest, outcome.manifest_key or "")
        res.status = "committed"
        res.total_s = time.perf_counter() - t0
        self.history.append(res)
        log.info("%s", res.line())
        if self.on_save is not None:
            self.on_save(res)
        return res

    async def _commit(self, number: int, res: SaveResult, metrics: dict[str, Any],
                      parts: list[RankPart]) -> tuple[Outcome, VersionManifest | None]:
        """Rank 0: write the manifest iff every rank's blobs are durable."""
        bad = [p for p in parts if p.error is not None]
        if bad:
            return Outcome(committed=False, failed_rank=bad[0].rank,
                           error=f"rank {bad[0].rank} failed: {bad[0].error}"), None
        key = self.layout.manifest_key(number)
        try:
            manifest = await self._build_manifest(number, res, metrics, parts)
            await self.store.put_if_absent(key, dump_model(manifest))
        except Exception as err:
            self._commit_error = err  # raised as itself when this process is the only rank
            return Outcome(committed=False, failed_rank=0,
                           error=f"rank 0 could not commit {key}: {type(err).__name__}: {err}"
                           ), None
        return Outcome(committed=True, manifest_key=key), manifest

    async def _after_commit(self, manifest: VersionManifest, key: str) -> None:
        """Rank 0, after the manifest is durable: aliases, run manifest, retention."""
        await self.catalog.move_latest(manifest, key)
        await self.catalog.move_best(manifest, key, self.cfg.best_metric_name, self.cfg.best_mode)
        await self.catalog.update_run_manifest(self._root_local(), self._root_remote())
        try:
            await self._apply_retention()
        except Exception as err:  # the version is committed; leftovers are cleaned at start
            log.warning("retention after %s failed (will retry after the next save): %r",
                        manifest.version_id, err)

    async def _write_part(self, number: asyncio.Future[int], res: SaveResult,
                          items: list[StagedItem], json_states: dict[str, Any],
                          rng: dict[str, Any], updates: list[_ChainUpdate],
                          roles: Roles | None = None) -> RankPart:
        """Write this rank's blobs and RNG file durably; report what was written.

        ``number`` is the version number being agreed: blobs start encoding before it is
        known (their keys wait for it).  ``updates`` receives the chain bookkeeping to apply
        once the version commits.
        """
        part = RankPart(rank=self.rank)
        loop = asyncio.get_running_loop()

        async def agreed() -> int:  # shielded: a failed write must not cancel the agreement
            return await asyncio.shield(number)

        if self._lossy is not None:
            items = await self._write_lossy(await agreed(), res, items, roles or {}, part)

        async def key_of(name: str) -> str:
            n = await agreed()
            if name == "model" and self.rank == 0 and not self.sharded_model:
                return self.layout.model_key(n, self._codec.model_ext)
            return self.layout.shard_key(n, name, self.rank)

        async def write_item(item: StagedItem) -> tuple[StagedItem, BlobRef] | None:
            chain = self._chains[item.name]
            plan, hashes = (await loop.run_in_executor(self._pool, plan_item, chain, item.tensors)
                            if self.chain_policy.double_buffer else (EncodePlan(), {}))
            if item.name == "model" and self.rank != 0 and not self.sharded_model:
                return None
            key = asyncio.ensure_future(key_of(item.name))
            try:
                ref = await self._codec.write(self.store, key, item, step=res.step, plan=plan)
            finally:
                key.cancel()  # no-op once done; stops a key still waiting when writing failed
            updates.append((chain, item.area_idx, ref, plan, hashes, list(item.tensors)))
            return item, ref

        part.exact = all(not isinstance(s, dict) or s.get("exact", True) is not False
                         for s in json_states.values())
        rng_doc = {"rank": self.rank, "step": res.step, "rng": rng, "states": json_states,
                   "exact": part.exact}
        rng_bytes = json.dumps(rng_doc).encode()
        part.rng_xxh64 = xxhash.xxh64_hexdigest(rng_bytes)

        async def write_rng() -> None:
            part.rng_key = self.layout.rng_key(await agreed(), self.rank)
            await self.store.put(part.rng_key, rng_bytes)

        # items (and the RNG file) are written concurrently: one blob's fsync waits on the
        # disk while the codec threads encode the next one
        written = await all_or_first_error([write_item(item) for item in items] + [write_rng()])
        for out in written[:len(items)]:
            if out is None:
                continue
            item, ref = out
            part.bytes_in += ref.raw_bytes
            part.bytes_out += ref.bytes
            if item.name == "model" and self.rank == 0 and not self.sharded_model:
                part.model = ref
            else:
                part.shards[item.name] = ShardRef(rank=self.rank, **ref.model_dump())
        res.bytes_in += part.bytes_in
        res.bytes_out += part.bytes_out
        return part

    async def _write_lossy(self, number: int, res: SaveResult, items: list[StagedItem],
                           roles: Roles, part: RankPart) -> list[StagedItem]:
        """Encode and store this rank's lossy blob; return the items without its tensors.

        Only the rank-0 model is coded lossily when the model is not sharded (as for the
        lossless model blob); the staged buffers are read, never changed."""
        assert self._lossy is not None
        if self.rank != 0 and not self.sharded_model:
            roles = {k: v for k, v in roles.items() if not k.startswith("model/")}
        lossy_state, rest = self._lossy.split(items, roles)
        if not lossy_state:
            if not self._lossy_idle_warned:  # enabled but nothing qualifies: say so, once
                self._lossy_idle_warned = True
                log.warning("[checkpointing.lossy] is enabled but no tensor of rank %d "
                            "qualifies (model parameters with named_parameters() and their "
                            "Adam moments, float, >= min_numel elements, not exact): this "
                            "save is lossless", self.rank)
            return items
        loop = asyncio.get_running_loop()
        ckpt = await loop.run_in_executor(self._pool, self._lossy.encode, lossy_state, roles)
        shard = await write_lossy(self.store, self.layout.lossy_key(number, self.rank), ckpt,
                                  self._lossy.base, self.rank, self._pool, self.cfg.lossy.level)
        part.lossy = self._lossy.entry(ckpt, shard)
        part.bytes_in += shard.raw_bytes
        part.bytes_out += shard.bytes
        return rest

    async def _build_manifest(self, number: int, res: SaveResult, metrics: dict[str, Any],
                              parts: list[RankPart]) -> VersionManifest:
        model = parts[0].model
        if model is None:  # a sharded model: rank 0's shard stands for the model entry
            model = parts[0].shards["model"]
        shards: dict[str, list[ShardRef]] = {}
        for p in parts:
            for name, ref in p.shards.items():
                shards.setdefault(name, []).append(ref)
        optimizer = None
        if "optimizer" in shards:
            optimizer = OptimizerEntry(sharding="per_rank", shards=shards.pop("optimizer"))
        lossy = None
        if parts[0].lossy is not None:
            lossy = parts[0].lossy.model_copy(update={"shards": [
                s for p in parts if p.lossy is not None for s in p.lossy.shards]})
        quantized = lossy is not None and bool(lossy.quantized)
        exact = all(p.exact for p in parts) and not quantized
        return VersionManifest(
            run_id=self.run_id, version_id=version_id(number), created_at=utcnow(),
            step=res.step, world_size=self.world_size,
            paths={"root_local": self._root_local(),
                   "root_remote": self._root_remote()},
            config=await self._write_config(), model=BlobRef(**model.model_dump(
                exclude={"rank"})), optimizer=optimizer,
            rng=RngEntry(per_rank=True, keys=[RankKey(rank=p.rank, key=p.rng_key or "",
                                                      xxh64=p.rng_xxh64) for p in parts]),
            extra=shards, resume=ResumeInfo(base_step=res.step, exact=exact), metrics=metrics,
            compression=self._codec.describe(),
            stats=SaveStats(stall_s=res.stall_s, bytes_in=sum(p.bytes_in for p in parts),
                            bytes_out=sum(p.bytes_out for p in parts)),
            has_quantization=quantized, lossy=lossy,
        )

    async def _write_config(self) -> BlobRef | None:
        """Write config/train.toml and config.json once per run; return the TOML's ref."""
        toml = (self.config.source_toml or "").encode()
        key = self.layout.config_key("train.toml")
        if not self._config_written:
            if not await self.store.exists(key):
                await self.store.put(key, toml)
                cfg_json = json.dumps(self.config.model_dump(mode="json"), indent=2).encode()
                await self.store.put(self.layout.config_key("config.json"), cfg_json)
            self._config_written = True
        data = await self.store.get(key)
        return BlobRef(key=key, bytes=len(data), xxh64=xxhash.xxh64_hexdigest(data),
                       format="toml")

    async def _discard(self, number: int) -> None:
        """Remove whatever an aborted save left in its version folder."""
        try:
            keys = await self.store.list(self.layout.version_dir(number) + "/")
            # a manifest that landed before its commit failed goes first: never a manifest
            # without its blobs, even if this cleanup is cut short
            for key in sorted(keys, key=lambda k: not k.endswith("/manifest.json")):
                await self.store.delete(key)
        except Exception as err:  # the next start cleans what remains
            log.warning("could not clean aborted version %s: %r", version_id(number), err)

    def _root_remote(self) -> str | None:
        r = self.cfg.remote
        return None if r is None else f"s3://{r.bucket}/{r.prefix}".rstrip("/")

    def _root_local(self) -> str | None:
        root = getattr(self.store, "root", None)
        return None if root is None else str(root)

    def _policies(self) -> list[Policy]:
        c = self.cfg
        out: list[Policy] = []
        if c.keep_last:
            out.append(KeepLastN(c.keep_last))
        if c.keep_best and c.best_metric_name:
            out.append(KeepBestN(c.keep_best, c.best_metric_name, c.best_mode))
        if c.keep_every_n_steps:
            out.append(KeepEveryNSteps(c.keep_every_n_steps))
        return out

    async def _apply_retention(self) -> list[str]:
        policies = self._policies()
        if not policies:
            return []
        versions = await self.catalog.versions(skip_damaged=True)
        protected = set()
        for name in ("latest", "best"):
            alias = await self.catalog.read_alias(name)
            if alias is not None and alias.version_id:
                protected.add(alias.version_id)
        _, delete = plan_retention(versions, policies, protected)
        for vid in delete:
            await self.catalog.delete_version(vid)
            if self._steps is not None:
                self._steps.discard(next(v.step for v in versions if v.version_id == vid))
        if delete:
            log.info("retention deleted %s", ", ".join(delete))
            await self.catalog.update_run_manifest(self._root_local(), self._root_remote())
        return delete

    async def wait_until_finished(self) -> None:
        """Wait for the in-flight save; raise :class:`SaveFailed` if it failed."""
        fut = self._inflight
        if fut is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(fut)
        self.check_for_errors()

    def wait(self) -> None:
        """Synchronous :meth:`wait_until_finished`."""
        fut = self._inflight
        if fut is not None:
            concurrent.futures.wait([fut])
        self.check_for_errors()

    # ------------------------------------------------------------ restore
    async def restore(self, target: str | int = "latest", *, fallback: bool = False,
                      load: Literal["all", "model"] = "all") -> int:
        """Load a committed version into the live state; return its step.

        ``fallback=True``: if the target fails verification, the newest older version that
        verifies is loaded instead (and a warning names what was skipped).
        """
        decoded = await asyncio.wrap_future(self.loop.submit(
            self._read_version(target, fallback, load)))
        manifest, trees, rng_doc = decoded
        self._apply(manifest, trees, rng_doc, load)
        return manifest.step

    def restore_sync(self, target: str | int = "latest", *, fallback: bool = False,
                     load: Literal["all", "model"] = "all") -> int:
        manifest, trees, rng_doc = self._bg(self._read_version(target, fallback, load))
        self._apply(manifest, trees, rng_doc, load)
        return int(manifest.step)

    async def _read_version(self, target: str | int, fallback: bool, load: str = "all"
                            ) -> tuple[VersionManifest, dict[str, Any], dict[str, Any]]:
        key = await self.catalog.resolve(target)
        try:
            return await self._decode_version(key, load)
        except _RESTORE_ERRORS as err:
            if not fallback:
                raise
            first_err = err
        bad_vid = key.rsplit("/", 2)[-2]
        try:
            bad_step: int | None = (await self.catalog.read_manifest(key)).step
        except _RESTORE_ERRORS:  # the manifest itself is damaged: older version numbers
            bad_step = None
        for m in reversed(await self.catalog.versions(skip_damaged=True)):
            if (m.step >= bad_step if bad_step is not None
                    else version_number(m.version_id) >= version_number(bad_vid)):
                continue
            cand = self.layout.manifest_key(version_number(m.version_id))
            try:
                out = await self._decode_version(cand, load)
            except _RESTORE_ERRORS as err:
                log.warning("fallback: %s does not verify either: %s", m.version_id, err)
                continue
            log.warning("restore fell back from %s (%s) to %s (step %d)", bad_vid,
                        first_err, m.version_id, m.step)
            return out
        raise VersionNotFound(f"no version at or before {bad_vid} verifies; "
                              f"first error: {first_err}") from first_err

    async def _decode_version(self, key: str, load: str = "all"
                              ) -> tuple[VersionManifest, dict[str, Any], dict[str, Any]]:
        m = await self.catalog.read_manifest(key)
        self._check_world_size(m, load)
        refs: dict[str, BlobRef] = {"model": m.model}
        if m.optimizer is not None and load != "model":
            refs["optimizer"] = self._rank_ref(m, "optimizer", m.optimizer.shards)
        for name, shards in m.extra.items():
            if load != "model" or name == "model":
                refs[name] = self._rank_ref(m, name, shards)
        load_blob = BaseLoader(self.catalog, self._codec, m.version_id)
        trees: dict[str, Any] = {}
        lossy = await self._read_lossy(m)
        if load == "model":  # per-rank RNG/data state is not restored for a model-only load
            skeleton, tensors = await self._codec.read(self.store, refs["model"], load_blob)
            trees["model"] = unflatten_state(skeleton, merge_lossy("model", tensors, lossy))
            return m, trees, {}
        # items decode concurrently: one's reads and Python work overlap another's decoding
        decoded = await all_or_first_error([self._codec.read(self.store, ref, load_blob)
                                            for ref in refs.values()])
        for name, (skeleton, tensors) in zip(refs, decoded, strict=True):
            trees[name] = unflatten_state(skeleton, merge_lossy(name, tensors, lossy))
        rng_ref = self._rank_ref(m, "rng", m.rng.keys)
        rng_key = rng_ref.key
        rng_bytes = await self.catalog._get_metadata(rng_key)
        if rng_ref.xxh64 is not None:  # RNG and data-loader state: never loaded if damaged
            got = xxhash.xxh64_hexdigest(rng_bytes)
            if got != rng_ref.xxh64:
                raise ChecksumMismatch(rng_key, rng_ref.xxh64, got)
        try:
            rng_doc = json.loads(rng_bytes)
        except ValueError as err:
            raise InvalidFormat(f"{rng_key}: not valid JSON ({err})") from None
        if not isinstance(rng_doc, dict) or rng_doc.get("step") != m.step:
            # the RNG file is checksummed by the manifest and records the step: a manifest
            # whose step was altered (it carries no checksum of its own) is caught here
            raise InvalidFormat(f"{key}: says step {m.step} but {rng_key} was saved at step "
                                f"{rng_doc.get('step') if isinstance(rng_doc, dict) else '?'}")
        return m, trees, rng_doc

    async def _read_lossy(self, m: VersionManifest) -> dict[str, Any]:
        """This rank's lossy tensors of ``m``, decoded along its chain (empty if lossless)."""
        if m.lossy is None:
            return {}
        rank = self.rank if m.world_size == self.world_size else 0

        async def manifest_of(vid: str) -> VersionManifest:
            return await self.catalog.read_manifest(
                self.layout.manifest_key(version_number(vid)))

        return await read_lossy_chain(self.store, m, rank, self._pool, manifest_of)

    def _check_world_size(self, m: VersionManifest, load: str) -> None:
        """Refuse a restore across world sizes unless it is the full model of rank 0."""
        if m.world_size == self.world_size:
            return
        sharded = "model" in m.extra
        if load == "model" and not sharded:
            return
        possible = (f"restore with {m.world_size} rank(s) for an exact resume (model, optimizer "
                    "shards, RNG and data state)")
        if not sharded:
            possible += ("; or restore(..., load='model') to load the full model written by "
                         "rank 0 on every rank and start the optimizer afresh")
        else:
            possible += "; its model is sharded per rank, so no model-only load either"
        raise DistributedError(
            f"{m.version_id} was saved by {m.world_size} rank(s) but this job has "
            f"{self.world_size} (rank {self.rank}); resharding is not supported. Possible: "
            f"{possible}")

    def _rank_ref(self, m: VersionManifest, what: str, refs: Sequence[R]) -> R:
        """This rank's entry of a per-rank list, or a clear error about the world size."""
        for ref in refs:
            if getattr(ref, "rank", None) == self.rank:
                return ref
        raise DistributedError(
            f"{m.version_id} was saved by {m.world_size} rank(s) and has no {what} shard for "
            f"rank {self.rank} (world size now {self.world_size}); restore with the same world "
            "size, or load the model only (restore(..., load='model')) on rank 0")

    def _apply(self, m: VersionManifest, trees: dict[str, Any], rng_doc: dict[str, Any],
               load: str) -> None:
        if self._guard is not None:  # a copy still reading the live tensors finishes first
            self._guard.wait()
        for name, obj in self.state.items():
            if load == "model" and name != "model":
                continue
            if name == "optimizer" and not self.cfg.resume_optimizer:
                continue
            if isinstance(obj, Stateful):
                if name not in trees:
                    raise VersionNotFound(f"{m.version_id} has no state for {name!r}")
                obj.load_state_dict(trees[name])
            elif name in rng_doc.get("states", {}):
                obj.set_state(rng_doc["states"][name])
        if load == "all":
            restore_rng(rng_doc["rng"])
        for chain in self._chains.values():
            chain.reset()  # the live state no longer matches the staged base
        if self._lossy is not None:
            self._lossy.reset()  # nor the lossy chain's reconstruction
        if self._steps is not None:
            self._steps.add(m.step)
