"""One save, start to finish: :class:`SaveJob` owns a save's snapshot hand-off, encoding,
version agreement, commit and retention; :class:`SaveContext` is what all saves of one
manager share.

The split follows who lives how long. The manager lives for the run: lifecycle, public API,
the step guard of overlapped snapshots. A :class:`SaveContext` lives as long as the manager
and holds what one save hands to the next (the staging buffers and delta chains, the lossy
track, the steps already committed). A :class:`SaveJob` lives for one save and holds
everything that belongs to that save alone (its staged items, the overlapped copy still
running, a commit error to re-raise), so no save leaves state behind on the manager.

Protocol (every rank runs it on its background loop):

1. ``snapshot()`` on the caller's thread copies the state into the chains' staging buffers;
   with ``snapshot = "overlapped"`` the optimizer-owned tensors are copied by a background
   thread after ``save()`` returns (:mod:`mithril_async.pipeline.overlap`).
2. ``run()``: the version number is agreed (rank 0 claims it) while this rank already encodes;
   blob keys are futures, so the first bytes wait for the number, not the encoder.
3. Every rank writes its blobs and RNG file durably and reports a :class:`RankPart`.
4. Rank 0 writes the manifest iff every part is good, its claim is still its own (a heartbeat
   keeps the claim fresh while the save runs, so no other process takes it for abandoned) and
   every blob is present with its size; then aliases, ``run.json`` and retention. Every rank
   learns the outcome; a failed or cancelled save deletes what it wrote (unless its claim was
   lost: the folder may be another writer's now) and never touches the last committed version.

Under ``[checkpointing.pipeline] host_memory_mib`` every save is accounted against the
budget (``SaveResult.host_peak_bytes``). A state whose staged path (staging buffers, 2x with
delta chains, plus the encode window) fits goes that path unchanged. Otherwise the snapshot
*streams* (:meth:`SaveJob.snapshot` -> :class:`~mithril_async.pipeline.stager.StreamSnapshot`):
the staging buffers are freed, the live tensors are copied out chunk by chunk through a ring
of reused slots by the encoder, and ``save()`` waits (:meth:`SaveJob.wait_consumed`) until
every chunk it must not change has been copied out: all of them with ``snapshot =
"blocking"``; with ``"overlapped"`` all but the optimizer-owned ones, whose remaining
copy-out the step pre-hook waits for (:class:`~mithril_async.pipeline.overlap.StreamCopy`).
A streamed save is a keyframe: holding a delta base whole is what the budget rules out, and
reading base chunks back from the store would cost a read (and a decode) of every chunk of
the base per save; the chains restart once the budget allows staging again.

Other processes may share the run (a second writer, ``mithril gc``): a delta's base could be
deleted by their retention. The claim names the bases this save reads (retention keeps them
while the claim is live), each blob re-checks its bases after it is written (gone: the blob is
written again as a keyframe) and the commit checks them once more (gone: ``MissingPrevious``,
and the next save is a keyframe).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.claims import Claim, heartbeat_interval
from mithril_async.config import Config
from mithril_async.distributed import pieces_of
from mithril_async.errors import (
    ClaimLost,
    DistributedError,
    HostMemoryExceeded,
    KeyNotFound,
    MissingPrevious,
)
from mithril_async.layout import RunLayout
from mithril_async.manifest import (
    BaseRef,
    BlobRef,
    OptimizerEntry,
    PieceMeta,
    RankKey,
    ResumeInfo,
    RngEntry,
    SaveStats,
    ShardRef,
    VersionManifest,
    dump_model,
    utcnow,
    version_id,
)
from mithril_async.pipeline.blobs import BlobCodec, EncodePlan, StagedItem, thread_scratch
from mithril_async.pipeline.chain import (
    ChainPolicy,
    ItemChain,
    commit_item,
    depends_on,
    plan_item,
)
from mithril_async.pipeline.coordinator import Coordinator, Outcome, RankPart
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.pipeline.lossy import LossyTrack, Roles, lossy_roles, write_lossy
from mithril_async.pipeline.overlap import OverlapCopy, StepGuard, StreamCopy
from mithril_async.pipeline.results import SaveResult
from mithril_async.pipeline.stager import (
    PLAIN_TYPES,
    HostBudget,
    SlotRing,
    Snapshot,
    StreamSnapshot,
    mib,
)
from mithril_async.retention import Policy, apply_retention
from mithril_async.state import Stateful, capture_rng, flatten_state
from mithril_async.storage.base import Store

log = logging.getLogger("mithril_async")

#: chain bookkeeping applied after a commit: chain, buffer set, blob, plan, hashes, names
_ChainUpdate = tuple[ItemChain, int, BlobRef, EncodePlan, dict[str, int], list[str]]


@dataclass
class SaveContext:
    """What the saves of one manager share, and hand from one save to the next."""

    config: Config
    state: dict[str, Any]
    store: Store
    layout: RunLayout
    catalog: RunCatalog
    coordinator: Coordinator
    pool: concurrent.futures.ThreadPoolExecutor
    codec: BlobCodec
    chain_policy: ChainPolicy
    #: what survives retention (None: everything); built once from the config or injected
    retention: Policy | None
    #: each rank saves its own model shard (FSDP/DTensor) instead of rank 0 the whole model
    sharded_model: bool = False
    #: the opt-in lossy tier ([checkpointing.lossy]); None keeps the lossless path as is
    lossy: LossyTrack | None = None
    #: per item: its staging buffers and delta chain, made at its first save
    chains: dict[str, ItemChain] = field(default_factory=dict)
    history: list[SaveResult] = field(default_factory=list)
    on_save: Callable[[SaveResult], None] | None = None
    #: steps committed in this run (known once the manager has started)
    steps: set[int] | None = None
    #: the run's config/train.toml as recorded by every manifest (written once per run)
    config_ref: BlobRef | None = None
    lossy_idle_warned: bool = False
    #: the slot ring of streamed saves (host_memory_mib), reused while its size fits
    ring: SlotRing | None = None

    def __post_init__(self) -> None:
        remote = self.config.checkpointing.remote
        if remote is not None:  # an S3 upload buffers parts (storage/s3/writer.py)
            self.codec.write_buffer_bytes += (remote.max_concurrency + 2) * (
                remote.part_mib << 20)

    @property
    def memory(self) -> HostBudget:
        return self.codec.memory

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def root_local(self) -> str | None:
        root = getattr(self.store, "root", None)
        return None if root is None else str(root)

    def root_remote(self) -> str | None:
        r = self.config.checkpointing.remote
        return None if r is None else f"s3://{r.bucket}/{r.prefix}".rstrip("/")

    def chain(self, name: str) -> ItemChain:
        chain = self.chains.get(name)
        if chain is None:  # once per item: its staging buffers live in the chain
            chain = self.chains[name] = ItemChain(self.chain_policy)
        return chain

    async def discard(self, number: int) -> None:
        """Remove whatever an aborted save left in its version folder."""
        try:
            keys = await self.store.list(self.layout.version_dir(number) + "/")
            # a manifest that landed before its commit failed goes first: never a manifest
            # without its blobs, even if this cleanup is cut short
            for key in sorted(keys, key=lambda k: not k.endswith("/manifest.json")):
                await self.store.delete(key)
        except Exception as err:  # the next start cleans what remains
            log.warning("could not clean aborted version %s: %r", version_id(number), err)


class SaveJob:
    """One save: ``snapshot()`` on the caller's thread, then ``run()`` on the background loop."""

    def __init__(self, ctx: SaveContext, step: int, t0: float) -> None:
        self.ctx = ctx
        self.step = step
        self.t0 = t0
        self.snaps: dict[str, Snapshot] = {}
        self._skeletons: dict[str, Any] = {}
        self._areas: dict[str, int] = {}
        self._json_states: dict[str, Any] = {}
        self._rng: dict[str, Any] = {}
        self._roles: Roles = {}
        #: per item: where each tensor sits in its global tensor (sharded state; issue 25)
        self._pieces: dict[str, dict[str, PieceMeta]] = {}
        #: snapshot = "overlapped": the copy still running after save() returned
        self.overlap: OverlapCopy | None = None
        #: streamed under host_memory_mib: the live tensors the encoder copies out
        self.stream: StreamSnapshot | None = None
        #: host bytes of tensors that had to be copied whole to be streamed (non-contiguous)
        self._materialized = 0
        #: streamed with snapshot = "overlapped": what the step pre-hook waits on
        self._stream_copy: StreamCopy | None = None
        #: rank 0's own commit error, raised as itself when this process is the only rank
        self._commit_error: Exception | None = None
        #: rank 0: the version's claim, and the task renewing its heartbeat while the save runs
        self._claim: Claim | None = None
        self._heartbeat: asyncio.Future[None] | None = None
        self.result: SaveResult | None = None

    # ------------------------------------------------------------ on the caller's thread
    def snapshot(self, defer: frozenset[int], guard: StepGuard | None) -> list[Snapshot]:
        """Copy every stateful object's tensors into the chains' reused buffers (the stall).

        ``defer``: addresses of tensors an overlapped snapshot copies after ``save()``
        returns, on ``guard``'s copy threads. Returns the snapshots whose device copies the
        caller must wait for before the state may change. Under ``host_memory_mib``, a state
        whose staged copy does not fit is streamed instead (nothing is copied here; the
        caller then waits in :meth:`wait_consumed`)."""
        ctx = self.ctx
        flat: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        for name, obj in ctx.state.items():
            if isinstance(obj, Stateful):
                flat[name] = flatten_state(obj.state_dict())
                self._pieces[name] = pieces_of(obj, flat[name][1])  # shard metadata (issue 25)
            else:
                self._json_states[name] = obj.get_state()
        ctx.memory.reset_peak()
        if self._staged_fits(flat):
            if ctx.ring is not None:  # the budget allows staging again: the ring goes
                ctx.ring = None
                ctx.memory.set_fixed("ring", 0)
            for name, (skeleton, tensors) in flat.items():
                chain = ctx.chain(name)
                self._areas[name] = chain.write_idx
                self.snaps[name] = chain.areas[chain.write_idx].snapshot(tensors, defer)
                self._skeletons[name] = skeleton
            ctx.memory.set_fixed("staging", sum(a.nbytes for c in ctx.chains.values()
                                                for a in c.areas))
            ctx.memory.set_fixed("codec", ctx.codec.threads
                                 * thread_scratch(ctx.codec.params.chunk_bytes))
        else:
            self._stream_snapshot(flat, defer, guard)
        self._roles = lossy_roles(ctx.state) if ctx.lossy is not None else {}
        self._rng = capture_rng()
        if guard is not None and self.stream is None:
            self.overlap = self._start_overlap(guard)
        return list(self.snaps.values())

    def _staged_fits(self, flat: dict[str, tuple[Any, dict[str, torch.Tensor]]]) -> bool:
        """Whether today's staged path fits the budget: staging buffers (one set, two with
        delta chains) plus what each blob's encoding may hold at once."""
        limit = self.ctx.memory.limit
        if limit is None:
            return True
        sets = 2 if self.ctx.chain_policy.double_buffer else 1
        codec = self.ctx.codec
        need = codec.threads * thread_scratch(codec.params.chunk_bytes)
        for name, (skeleton, tensors) in flat.items():
            item = StagedItem(name, skeleton, tensors)
            need += sets * item.nbytes + self.ctx.codec.write_reserve(item)
        return need <= limit

    def _stream_snapshot(self, flat: dict[str, tuple[Any, dict[str, torch.Tensor]]],
                         defer: frozenset[int], guard: StepGuard | None) -> None:
        """Hand the live tensors to the encoder through the slot ring (see module doc)."""
        ctx, memory = self.ctx, self.ctx.memory
        limit = memory.limit
        assert limit is not None
        if ctx.lossy is not None:
            raise HostMemoryExceeded(
                "[checkpointing.lossy] keeps a reconstruction of the state's weights and "
                "moments in host memory, more than host_memory_mib = "
                f"{mib(limit)} allows for this state; nothing was saved")
        for chain in ctx.chains.values():  # no staged copy, no delta base held
            chain.release()
            chain.reset()
        memory.set_fixed("staging", 0)
        admissions = {name: ctx.codec.admission(StagedItem(name, skel, tensors, stream={}))
                      for name, (skel, tensors) in flat.items()}  # (stream: as streamed)
        ring = self._ring(max(admissions.values(), default=0))
        for name, need in admissions.items():  # what cannot be split must fit at once
            if need > limit - memory.fixed:
                raise HostMemoryExceeded(_too_big(name, flat[name][0], need, limit,
                                                  memory.fixed))
        for name, value in self._json_states.items():
            size = len(json.dumps(value, default=str))
            if size > limit - memory.fixed:
                raise HostMemoryExceeded(
                    f"the state of {name!r} (get_state(), {mib(size)} as JSON) cannot be "
                    f"split and exceeds host_memory_mib = {mib(limit)}; nothing was saved")
        res_holder = self

        def on_now() -> None:  # the caller may go on: its stall ends here
            if res_holder.result is not None:
                res_holder.result.stall_s = time.perf_counter() - res_holder.t0

        stream = StreamSnapshot(ring, on_now)
        try:
            for name, (skeleton, tensors) in flat.items():
                ctx.chain(name)
                self._areas[name] = 0
                self._skeletons[name] = skeleton
                if self._whole_model(name) and ctx.rank != 0:
                    continue  # rank 0 alone writes it
                for tname, src in tensors.items():
                    t = self._streamable(f"{name}/{tname}", src)
                    later = bool(t.numel()) and t.data_ptr() in defer
                    stream.add(name, tname, t, later)
        except BaseException:
            memory.release(self._materialized)
            self._materialized = 0
            raise
        stream.start()
        self.stream = stream
        if guard is not None and stream.later_left:
            self._stream_copy = guard.pending = StreamCopy(stream)

    def _ring(self, admission: int) -> SlotRing:
        """The slot ring and codec lanes for this budget. A lane is one chunk in flight: its
        ring slot, its two chunks of budget (encoding, encoded block) and a codec thread's
        own buffers; as many lanes as the codec has threads, if the budget leaves room beside
        one blob's admission."""
        ctx = self.ctx
        limit = ctx.memory.limit
        assert limit is not None
        chunk = ctx.codec.params.chunk_bytes
        scratch = thread_scratch(chunk)
        lanes = max(1, min(ctx.codec.threads, (limit - admission) // (3 * chunk + scratch)))
        ctx.codec.lanes(lanes)
        ctx.memory.set_fixed("codec", lanes * scratch)
        pin = torch.cuda.is_available()
        ring = ctx.ring
        if ring is None or len(ring.buffers) != lanes or ring.slot_bytes != chunk \
                or ring.pinned != pin:
            ctx.ring = None
            ctx.memory.set_fixed("ring", 0)
            ring = ctx.ring = SlotRing(lanes, chunk, pin)
            ctx.memory.set_fixed("ring", ring.nbytes)
        return ring

    def _streamable(self, where: str, src: torch.Tensor) -> torch.Tensor:
        """A plain contiguous tensor with ``src``'s values, streamed chunk by chunk: ``src``
        itself (a DTensor's local shard) when it is one, else a whole copy, which on the
        host must fit the budget at once."""
        t = src.detach()
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            t = local.detach()
        if type(t) in PLAIN_TYPES and t.is_contiguous() and not t.is_conj() \
                and not t.is_neg():
            return t
        n = t.numel() * t.element_size()
        if t.device.type == "cpu":
            self.ctx.memory.take(n, f"tensor {where!r} (not contiguous: copied whole "
                                    "before it is streamed)")
            self._materialized += n
        return t.resolve_conj().resolve_neg().contiguous().as_subclass(torch.Tensor)

    def wait_consumed(self) -> None:
        """Streamed: block until the chunks the caller must not change have been copied out
        (all of them; with an overlapped snapshot all but the optimizer's). Else at once."""
        if self.stream is not None:
            concurrent.futures.wait([self.stream.now_done])

    async def consumed(self) -> None:
        """:meth:`wait_consumed` for an async caller."""
        if self.stream is not None:
            await asyncio.wrap_future(self.stream.now_done)

    def _start_overlap(self, guard: StepGuard) -> OverlapCopy | None:
        """Start the background copy of every item's deferred tensors (one thread job)."""
        staged = list(self.snaps.values())
        if not any(s.deferred or s.later_event is not None for s in staged):
            return None
        now = [s.event for s in staged if s.event is not None]
        for s in staged:  # the device copies are awaited by the pipeline, not by save()
            s.event = None
        copy = OverlapCopy([j for s in staged for j in s.deferred],
                           [w for s in staged for w in s.watch], guard.copy_threads,
                           events_now=now,
                           events_later=[s.later_event for s in staged
                                         if s.later_event is not None],
                           device_watch=[w for s in staged for w in s.later_watch])
        guard.pending = copy
        return copy

    def begin(self, metrics: Mapping[str, Any] | None, waited: float) -> SaveResult:
        """The snapshot is consistent: make the save's result (the stall ends here)."""
        res = SaveResult(self.step, stall_s=time.perf_counter() - self.t0, waited_s=waited,
                         streamed=self.stream is not None)
        self.result = res
        if self._stream_copy is not None:
            self._stream_copy.result = res
        self._metrics = dict(metrics or {})
        if self.overlap is not None:
            self.overlap.result = res
        return res

    # ------------------------------------------------------------ on the background loop
    async def run(self) -> SaveResult:
        """The background part; a lossy version that did not commit never becomes a base."""
        try:
            return await self._run()
        finally:
            if self.stream is not None:  # never leave the caller or a step waiting
                self.stream.close()
            self.ctx.memory.release(self._materialized)
            self._materialized = 0
            if self.result is not None:
                self.result.host_peak_bytes = self.ctx.memory.peak
            if self._heartbeat is not None:
                self._heartbeat.cancel()
            if self.ctx.lossy is not None:
                self.ctx.lossy.rollback()  # no-op once the version committed

    async def _claim_version(self) -> int:
        """Rank 0: claim the next version number, naming the committed versions this save's
        deltas and references read, and keep the claim's heartbeat going while it runs."""
        ctx = self.ctx
        claim = await ctx.catalog.claim(self._bases())
        self._claim = claim
        interval = heartbeat_interval(ctx.config.checkpointing.pipeline.claim_stale_s)
        self._heartbeat = asyncio.ensure_future(ctx.catalog.keep_claim_alive(claim, interval))
        return claim.number

    def _bases(self) -> set[str]:
        """Versions this save may read as delta bases or tensor holders (known before any
        planning: the chains' last committed bases)."""
        out: set[str] = set()
        for name in self.snaps:
            chain = self.ctx.chains.get(name)
            if chain is None:
                continue
            if chain.base_blob is not None:
                out.add(chain.base_blob.version_id)
            out |= {r.holder.version_id for r in chain.phys.values()}
        if self.ctx.lossy is not None and self.ctx.lossy.base is not None:
            out.add(self.ctx.lossy.base.version_id)
        return out

    async def _run(self) -> SaveResult:
        ctx, res = self.ctx, self.result
        assert res is not None, "begin() first"
        coord = ctx.coordinator
        # The version number is agreed (rank 0 claims it, then a broadcast) while this rank
        # already encodes: blob writers hold their first bytes until the number is known.
        agree = asyncio.ensure_future(coord.agree_version(self._claim_version))
        updates: list[_ChainUpdate] = []
        try:
            if self.overlap is not None:  # the staged buffers are complete (and untorn) first
                await self.overlap.finished()
            part = await self._write_part(agree, res, updates)
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError):
                if not agree.done():
                    agree.cancel()
                elif not agree.cancelled() and agree.exception() is None:
                    await asyncio.shield(ctx.discard(agree.result()))
                raise
            part = RankPart(rank=ctx.rank, error=f"{type(err).__name__}: {err}")
            local_err: BaseException | None = err
        else:
            local_err = None
        # every rank takes part in the agreement; its failure fails the save as before
        number = await agree
        res.version_id = version_id(number)
        try:
            parts = await coord.gather_parts(part)
        except DistributedError:  # a peer died or hung before any commit: drop our blobs
            await asyncio.shield(ctx.discard(number))
            raise
        outcome: Outcome | None = None
        manifest: VersionManifest | None = None
        if parts is not None:  # rank 0 decides
            try:
                outcome, manifest = await self._commit(number, res, parts)
            except asyncio.CancelledError:  # cancelled while committing: publish nothing
                await asyncio.shield(ctx.discard(number))
                raise
        outcome = await coord.broadcast_outcome(outcome)
        if not outcome.committed:
            res.status, res.error = "failed", outcome.error
            res.total_s = time.perf_counter() - self.t0
            ctx.history.append(res)
            log.error("save of step %d (%s) failed: %s", res.step, res.version_id, outcome.error)
            if not outcome.claim_lost:  # a lost claim's folder may be another writer's now
                await asyncio.shield(ctx.discard(number))
            local_err = local_err or self._commit_error
            if local_err is not None and coord.world_size == 1:
                raise local_err
            raise DistributedError(outcome.error or "save failed")
        if ctx.steps is not None:
            ctx.steps.add(res.step)
        for chain, idx, ref, plan, hashes, names in updates:
            commit_item(chain, idx, version_id(number), ref, plan, hashes, names)
        if ctx.lossy is not None and part.lossy is not None:
            mine = part.lossy.shards[0]
            ctx.lossy.commit(BaseRef(version_id=version_id(number), key=mine.key,
                                     xxh64=mine.xxh64))
        if manifest is not None:
            await self._after_commit(manifest, outcome.manifest_key or "")
        res.status = "committed"
        res.total_s = time.perf_counter() - self.t0
        res.host_peak_bytes = ctx.memory.peak
        ctx.history.append(res)
        log.info("%s", res.line())
        if ctx.on_save is not None:
            ctx.on_save(res)
        return res

    def _whole_model(self, name: str) -> bool:
        """Whether ``name`` is the unsharded model, which rank 0 alone writes."""
        return name == "model" and not self.ctx.sharded_model

    async def _write_part(self, number: asyncio.Future[int], res: SaveResult,
                          updates: list[_ChainUpdate]) -> RankPart:
        """Write this rank's blobs and RNG file durably; report what was written.

        ``number`` is the version number being agreed: blobs start encoding before it is
        known (their keys wait for it).  ``updates`` receives the chain bookkeeping to apply
        once the version commits.
        """
        ctx = self.ctx
        part = RankPart(rank=ctx.rank)
        loop = asyncio.get_running_loop()
        items = [StagedItem(name, self._skeletons[name], snap.tensors, self._areas[name])
                 for name, snap in self.snaps.items()]
        if self.stream is not None:  # the live tensors, copied out as they are encoded
            stream = self.stream
            items = [StagedItem(name, self._skeletons[name],
                                {n: t.src for n, t in stream.tensors.get(name, {}).items()},
                                0, stream.tensors.get(name, {}), stream.ring)
                     for name in self._skeletons]

        async def agreed() -> int:  # shielded: a failed write must not cancel the agreement
            return await asyncio.shield(number)

        if ctx.lossy is not None:
            items = await self._write_lossy(await agreed(), items, part)

        async def key_of(name: str) -> str:
            n = await agreed()
            if self._whole_model(name) and ctx.rank == 0:
                return ctx.layout.model_key(n, ctx.codec.model_ext)
            return ctx.layout.shard_key(n, name, ctx.rank)

        async def write_item(item: StagedItem) -> tuple[StagedItem, BlobRef] | None:
            chain = ctx.chains[item.name]
            plan, hashes = (await loop.run_in_executor(ctx.pool, plan_item, chain, item.tensors)
                            if ctx.chain_policy.double_buffer and item.stream is None
                            else (EncodePlan(), {}))
            if self._whole_model(item.name) and ctx.rank != 0:
                return None
            key = asyncio.ensure_future(key_of(item.name))
            try:
                ref = await ctx.codec.write(ctx.store, key, item, step=res.step, plan=plan)
            finally:
                key.cancel()  # no-op once done; stops a key still waiting when writing failed
            gone = await ctx.catalog.missing_bases(depends_on([ref]))
            if gone:  # another process's retention deleted a base meanwhile: keyframe instead
                log.warning("%s: base %s was deleted by another process; writing a keyframe",
                            ref.key, ", ".join(sorted({b.version_id for b in gone})))
                chain.reset()
                plan, hashes = await loop.run_in_executor(ctx.pool, plan_item, chain,
                                                          item.tensors)
                ref = await ctx.codec.write(ctx.store, ref.key, item, step=res.step, plan=plan)
            if item.stream is None:  # a streamed keyframe leaves no base behind
                updates.append((chain, item.area_idx, ref, plan, hashes, list(item.tensors)))
            return item, ref

        part.exact = all(not isinstance(s, dict) or s.get("exact", True) is not False
                         for s in self._json_states.values())
        rng_doc = {"rank": ctx.rank, "step": res.step, "rng": self._rng,
                   "states": self._json_states, "exact": part.exact}
        rng_bytes = json.dumps(rng_doc).encode()
        part.rng_xxh64 = xxhash.xxh64_hexdigest(rng_bytes)

        async def write_rng() -> None:
            part.rng_key = ctx.layout.rng_key(await agreed(), ctx.rank)
            await ctx.store.put(part.rng_key, rng_bytes)
            part.rng_bytes = len(rng_bytes)

        # items (and the RNG file) are written concurrently: one blob's fsync waits on the
        # disk while the codec threads encode the next one
        written = await all_or_first_error([write_item(item) for item in items] + [write_rng()])
        for out in written[:len(items)]:
            if out is None:
                continue
            item, ref = out
            part.bytes_in += ref.raw_bytes
            part.bytes_out += ref.bytes
            if self._whole_model(item.name) and ctx.rank == 0:
                part.model = ref
            else:
                pieces = {n: p for n, p in self._pieces.get(item.name, {}).items()
                          if n in item.tensors}  # issue 25: shard metadata hook
                part.shards[item.name] = ShardRef(rank=ctx.rank, pieces=pieces,
                                                  **ref.model_dump())
        res.bytes_in += part.bytes_in
        res.bytes_out += part.bytes_out
        return part

    async def _write_lossy(self, number: int, items: list[StagedItem],
                           part: RankPart) -> list[StagedItem]:
        """Encode and store this rank's lossy blob; return the items without its tensors.

        Only the rank-0 model is coded lossily when the model is not sharded (as for the
        lossless model blob); the staged buffers are read, never changed."""
        ctx = self.ctx
        assert ctx.lossy is not None
        roles = self._roles
        if ctx.rank != 0 and not ctx.sharded_model:
            roles = {k: v for k, v in roles.items() if not k.startswith("model/")}
        lossy_state, rest = ctx.lossy.split(items, roles)
        if not lossy_state:
            if not ctx.lossy_idle_warned:  # enabled but nothing qualifies: say so, once
                ctx.lossy_idle_warned = True
                log.warning("[checkpointing.lossy] is enabled but no tensor of rank %d "
                            "qualifies (model parameters with named_parameters() and their "
                            "Adam moments, float, >= min_numel elements, not exact): this "
                            "save is lossless", ctx.rank)
            return items
        loop = asyncio.get_running_loop()
        ckpt = await loop.run_in_executor(ctx.pool, ctx.lossy.encode, lossy_state, roles)
        shard = await write_lossy(ctx.store, ctx.layout.lossy_key(number, ctx.rank), ckpt,
                                  ctx.lossy.base, ctx.rank, ctx.pool,
                                  ctx.config.checkpointing.lossy.level)
        part.lossy = ctx.lossy.entry(ckpt, shard)
        part.bytes_in += shard.raw_bytes
        part.bytes_out += shard.bytes
        return rest

    async def _commit(self, number: int, res: SaveResult, parts: list[RankPart]
                      ) -> tuple[Outcome, VersionManifest | None]:
        """Rank 0: write the manifest iff every rank's blobs are durable."""
        bad = [p for p in parts if p.error is not None]
        if bad:
            return Outcome(committed=False, failed_rank=bad[0].rank,
                           error=f"rank {bad[0].rank} failed: {bad[0].error}"), None
        key = self.ctx.layout.manifest_key(number)
        try:
            manifest = await self._build_manifest(number, res, parts)
            await self._check_before_commit(manifest, parts)
            await self.ctx.store.put_if_absent(key, dump_model(manifest))
        except Exception as err:
            self._commit_error = err
            if isinstance(err, MissingPrevious):  # a base is gone: the next save is a keyframe
                for chain in self.ctx.chains.values():
                    chain.reset()
                if self.ctx.lossy is not None:
                    self.ctx.lossy.reset()
            return Outcome(committed=False, failed_rank=0,
                           error=f"rank 0 could not commit {key}: {type(err).__name__}: {err}",
                           claim_lost=self._claim is not None and self._claim.lost), None
        return Outcome(committed=True, manifest_key=key), manifest

    async def _check_before_commit(self, manifest: VersionManifest,
                                   parts: list[RankPart]) -> None:
        """What another process sharing the run could have broken since the blobs were
        written: the claim must still be this save's (a process that judged it abandoned
        removes the folder), every blob present with its size, every base still committed.
        Raises :class:`ClaimLost` / :class:`MissingPrevious`; nothing is published then."""
        ctx, claim = self.ctx, self._claim
        if claim is not None and (claim.lost or not await ctx.catalog.claim_is_own(claim)):
            claim.lost = True
            raise ClaimLost(f"{ctx.layout.claim_key(claim.number)}: the claim of "
                            f"{manifest.version_id} is no longer this process's "
                            f"({claim.reason or 'removed or replaced by another process'}); "
                            "nothing is published")
        sizes = {b.key: b.bytes for b in manifest.blobs()}
        sizes |= {p.rng_key: p.rng_bytes for p in parts
                  if p.rng_key is not None and p.rng_bytes is not None}

        async def check(key: str, expected: int) -> None:
            try:
                size = await ctx.store.size(key)
            except KeyNotFound:
                raise ClaimLost(f"{key} of {manifest.version_id} was removed before its commit "
                                "(by another process); nothing is published") from None
            if size != expected:
                raise ClaimLost(f"{key} of {manifest.version_id} has {size} bytes, "
                                f"{expected} were written; nothing is published")

        await asyncio.gather(*(check(k, n) for k, n in sizes.items()))
        gone = await ctx.catalog.missing_bases(depends_on(manifest.blobs()))
        if gone:
            names = ", ".join(sorted(f"{b.version_id} ({b.key})" for b in gone))
            raise MissingPrevious(f"{manifest.version_id} needs {names}, deleted by another "
                                  "process before the commit; nothing is published and the "
                                  "next save is a keyframe")

    async def _build_manifest(self, number: int, res: SaveResult, parts: list[RankPart]
                              ) -> VersionManifest:
        ctx = self.ctx
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
            run_id=ctx.layout.run_id, version_id=version_id(number), created_at=utcnow(),
            step=res.step, world_size=ctx.world_size,
            paths={"root_local": ctx.root_local(), "root_remote": ctx.root_remote()},
            config=await self._config_ref(), model=BlobRef(**model.model_dump(
                exclude={"rank"})), optimizer=optimizer,
            rng=RngEntry(per_rank=True, keys=[RankKey(rank=p.rank, key=p.rng_key or "",
                                                      xxh64=p.rng_xxh64) for p in parts]),
            extra=shards, resume=ResumeInfo(base_step=res.step, exact=exact),
            metrics=self._metrics, compression=ctx.codec.describe(),
            stats=SaveStats(stall_s=res.stall_s, bytes_in=sum(p.bytes_in for p in parts),
                            bytes_out=sum(p.bytes_out for p in parts)),
            has_quantization=quantized, lossy=lossy,
        )

    async def _config_ref(self) -> BlobRef:
        """Write config/train.toml and config.json once per run; return the TOML's ref.

        Only what :func:`~mithril_async.config.recorded_config` keeps is written ([checkpointing]
        and the tables ``record_config`` names, secrets redacted), privately (0600 on disk):
        runs are copied and shared, training TOMLs hold API keys. Read back (and remembered)
        rather than hashed from our own bytes: another process of the run may have written it
        first, and the manifest must describe the file as it is."""
        from mithril_async.config import recorded_config
        from mithril_async.storage.base import put_private

        ctx = self.ctx
        if ctx.config_ref is not None:
            return ctx.config_ref
        key = ctx.layout.config_key("train.toml")
        if not await ctx.store.exists(key):
            toml_bytes, json_bytes = recorded_config(ctx.config)
            await put_private(ctx.store, key, toml_bytes)
            await put_private(ctx.store, ctx.layout.config_key("config.json"), json_bytes)
        data = await ctx.store.get(key)
        ctx.config_ref = BlobRef(key=key, bytes=len(data), xxh64=xxhash.xxh64_hexdigest(data),
                                 format="toml")
        return ctx.config_ref

    async def _after_commit(self, manifest: VersionManifest, key: str) -> None:
        """Rank 0, after the manifest is durable: aliases, run manifest, retention."""
        ctx = self.ctx
        cfg = ctx.config.checkpointing
        await ctx.catalog.move_latest(manifest, key)
        await ctx.catalog.move_best(manifest, key, cfg.best_metric_name, cfg.best_mode)
        # one listing serves run.json and retention (the run is listed once more at claim)
        versions = await ctx.catalog.versions(skip_damaged=True)
        await ctx.catalog.update_run_manifest(ctx.root_local(), ctx.root_remote(),
                                              versions=versions)
        if ctx.retention is None:
            return
        try:
            deleted = await apply_retention(ctx.catalog, ctx.retention, versions=versions)
            if ctx.steps is not None:
                ctx.steps.difference_update(v.step for v in deleted)
            if deleted:
                gone = {v.version_id for v in deleted}
                await ctx.catalog.update_run_manifest(
                    ctx.root_local(), ctx.root_remote(),
                    versions=[v for v in versions if v.version_id not in gone])
        except Exception as err:  # the version is committed; leftovers are cleaned at start
            log.warning("retention after %s failed (will retry after the next save): %r",
                        manifest.version_id, err)


def _too_big(item: str, skeleton: Any, need: int, limit: int, fixed: int) -> str:
    """The message for an item whose unsplittable part (its non-tensor values, which travel
    in the blob header) does not fit the budget: it names the biggest such value."""
    path, size = _largest_value(skeleton, item)
    return (f"saving {item!r} needs {mib(need)} of host memory at once, mostly its non-tensor "
            f"values; the largest is {path!r} ({mib(size)} as JSON), which cannot be split; "
            f"host_memory_mib = {mib(limit)} leaves {mib(limit - fixed)} beside the "
            f"{mib(fixed)} of slot ring and codec buffers; nothing was saved")


def _largest_value(node: Any, path: str) -> tuple[str, int]:
    """Descend into the child holding most of ``node``'s JSON while one does."""
    size = len(json.dumps(node, separators=(",", ":")))
    children: list[tuple[str, Any]] = []
    if isinstance(node, dict) and isinstance(node.get("D"), list):
        children = [(f"{path}/{k if isinstance(k, str) else json.dumps(k)}", v)
                    for k, v in (kv for kv in node["D"] if isinstance(kv, list) and len(kv) == 2)]
    elif isinstance(node, dict):
        children = [(path, v) for v in node.values()]
    elif isinstance(node, list):
        children = [(f"{path}/{i}", v) for i, v in enumerate(node)]
    if children:
        sizes = [(len(json.dumps(v, separators=(",", ":"))), p, v) for p, v in children]
        best = max(sizes, key=lambda x: x[0])
        if best[0] * 2 > size:
            return _largest_value(best[2], best[1])
    return path, size
