"""One save, start to finish: :class:`SaveJob`.

A manager lives for the run (lifecycle, public API, the step guard of overlapped snapshots);
its :class:`~mithril_async.save.context.SaveContext` holds what one save hands to the next; a
:class:`SaveJob` lives for one save and holds everything that belongs to that save alone (its
snapshot, the overlapped copy still running, its version's claim), so no save leaves state
behind on the manager.

Protocol (every rank runs it; the snapshot on the caller's thread, the rest on the background
loop):

1. :meth:`SaveJob.snapshot` copies the state (staged or streamed:
   :mod:`~mithril_async.save.snapshot`); :meth:`SaveJob.begin` makes the save's result.
2. :meth:`SaveJob.run`: the version number is agreed (rank 0 claims it) while this rank
   already encodes; blob keys are futures, so the first bytes wait for the number, not the
   encoder.
3. Every rank writes its blobs and RNG file durably and reports a
   :class:`~mithril_async.save.coordinator.RankPart`.
4. Rank 0 commits the manifest iff every part is good and nothing another process did broke
   the version (:mod:`~mithril_async.save.commit`); then aliases, ``run.json`` and
   retention. Every rank learns the outcome; a failed or cancelled save deletes what it wrote
   (unless its claim was lost: the folder may be another writer's now) and never touches the
   last committed version.

Other processes may share the run (a second writer, ``mithril gc``): a delta's base could be
deleted by their retention. The claim names the bases this save reads, each blob re-checks its
bases after it is written (gone: the blob is written again as a keyframe) and the commit checks
them once more (gone: ``MissingPrevious``, and the next save is a keyframe).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import xxhash

from mithril_async.errors import DistributedError, NonFiniteState
from mithril_async.manifest import BaseRef, BlobRef, ShardRef, VersionManifest, version_id
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.save.commit import VersionCommit
from mithril_async.save.context import SaveContext
from mithril_async.save.coordinator import Outcome, RankPart
from mithril_async.save.items import EncodePlan, StagedItem
from mithril_async.save.nonfinite import count_tensors, mark_allowed
from mithril_async.save.results import SaveResult
from mithril_async.save.snapshot import HandedOff, StateSnapshot
from mithril_async.save.xor_chain import ItemChain, commit_item, depends_on, plan_item

if TYPE_CHECKING:
    from mithril_async.save.buffers import HostCopies
    from mithril_async.save.overlap import StepGuard

__all__ = ["SaveJob"]

log = logging.getLogger("mithril_async")

_Ref = TypeVar("_Ref", bound=BlobRef)

#: chain bookkeeping applied after a commit: chain, buffer set, blob, plan, hashes, names,
#: NaN/Inf counts by tensor name
_ChainUpdate = tuple[ItemChain, int, BlobRef, EncodePlan, dict[str, int], list[str],
                     dict[str, tuple[int, int]]]


class SaveJob:
    """One save: ``snapshot()`` on the caller's thread, then ``run()`` on the background loop."""

    def __init__(self, ctx: SaveContext, step: int, t0: float,
                 handed: HandedOff | None = None, overlap: Any = None) -> None:
        """``handed``: the snapshot another process took (a checkpoint worker's job, whose
        :meth:`snapshot` is never called; ``overlap`` says when that process's overlapped
        copy is complete); None: the live state is copied by :meth:`snapshot`."""
        self.ctx = ctx
        self.step = step
        self.t0 = t0
        self.snap = (_trainer_snapshot(ctx, self._stall_ends) if handed is None
                     else StateSnapshot(ctx))
        if handed is not None:
            self.snap.adopt(handed, overlap)
        #: rank 0: the version's claim and commit
        self.version = VersionCommit(ctx)
        self.result: SaveResult | None = None
        self._metrics: dict[str, Any] = {}
        #: the lossy tier stored NaN/Inf tensors exactly: its chain restarts after this save
        self._lossy_restart = False

    # ------------------------------------------------------------ on the caller's thread
    def snapshot(self, defer: frozenset[int], guard: StepGuard | None) -> list[HostCopies]:
        """Copy the state (the stall); the snapshots whose device copies the caller waits
        for (see :meth:`StateSnapshot.take`)."""
        from mithril_async.save.trainer_snapshot import TrainerSnapshot

        assert isinstance(self.snap, TrainerSnapshot), "a handed-off snapshot is taken already"
        return self.snap.take(defer, guard)

    def wait_consumed(self) -> None:
        """Streamed: block until the chunks the caller must not change are copied out."""
        self.snap.wait_consumed()

    async def consumed(self) -> None:
        """:meth:`wait_consumed` for an async caller."""
        await self.snap.consumed()

    def begin(self, metrics: Mapping[str, Any] | None, waited: float) -> SaveResult:
        """The snapshot is consistent: make the save's result (the stall ends here)."""
        res = SaveResult(self.step, stall_s=time.perf_counter() - self.t0, waited_s=waited,
                         streamed=self.snap.stream is not None)
        self.result = res
        if self.snap.stream_copy is not None:
            self.snap.stream_copy.result = res
        self._metrics = dict(metrics or {})
        if self.snap.overlap is not None:
            self.snap.overlap.result = res
        return res

    def adopt_result(self, res: SaveResult, metrics: Mapping[str, Any]) -> None:
        """Run with the result another process made at its snapshot (a worker's trainer:
        its stall and waits are measured there)."""
        self.result = res
        self._metrics = dict(metrics)

    def _stall_ends(self) -> None:
        """A streamed snapshot's caller may go on: its stall ends here."""
        if self.result is not None:
            self.result.stall_s = time.perf_counter() - self.t0

    # ------------------------------------------------------------ on the background loop
    async def run(self) -> SaveResult:
        """The background part; a lossy version that did not commit never becomes a base."""
        try:
            return await self._run()
        finally:
            self.snap.close()  # never leave the caller or a step waiting
            if self.result is not None:
                self.result.host_peak_bytes = self.ctx.memory.peak
            self.version.stop()
            if self.ctx.lossy is not None:
                self.ctx.lossy.rollback()  # no-op once the version committed

    async def _run(self) -> SaveResult:
        res = self.result
        assert res is not None, "begin() first"
        updates: list[_ChainUpdate] = []
        agree = asyncio.ensure_future(self.ctx.coordinator.agree_version(self._claim_version))
        part, local_err = await self._encode_and_write(agree, res, updates)
        try:
            number = await agree  # every rank takes part; its failure fails the save
        except BaseException:
            claim = self.version.claim  # rank 0 claimed before the agreement failed
            if claim is not None and not claim.lost:
                await asyncio.shield(self.ctx.discard(claim.number))
            raise
        res.version_id = version_id(number)
        outcome, manifest = await self._decide(number, res, part)
        res.nonfinite, res.held = dict(outcome.nonfinite), outcome.held
        if not outcome.committed:
            await self._failed(number, res, outcome, local_err)
        await self._committed(number, res, part, updates, outcome, manifest)
        return res

    async def _claim_version(self) -> int:
        """Rank 0: claim the next version number (see :class:`VersionCommit`)."""
        return await self.version.claim_version(self._bases())

    def _bases(self) -> set[str]:
        """Versions this save may read as delta bases or tensor holders (known before any
        planning: the chains' last committed bases)."""
        out: set[str] = set()
        for name in self.snap.staged:
            chain = self.ctx.chains.get(name)
            if chain is None:
                continue
            if chain.base_blob is not None:
                out.add(chain.base_blob.version_id)
            out |= {r.holder.version_id for r in chain.phys.values()}
        if self.ctx.lossy is not None and self.ctx.lossy.base is not None:
            out.add(self.ctx.lossy.base.version_id)
        return out

    async def _encode_and_write(self, agree: asyncio.Future[int], res: SaveResult,
                                updates: list[_ChainUpdate]
                                ) -> tuple[RankPart, BaseException | None]:
        """This rank's part, and its error if writing it failed (the part then says so).
        Cancelled: the agreement is cancelled too, or what was written under its number is
        removed."""
        try:
            if self.snap.overlap is not None:  # the staged buffers are complete and untorn
                await self.snap.overlap.finished()
            return await self._write_part(agree, res, updates), None
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError):
                if not agree.done():
                    agree.cancel()
                elif not agree.cancelled() and agree.exception() is None:
                    await asyncio.shield(self.ctx.discard(agree.result()))
                raise
            return RankPart(rank=self.ctx.rank, error=f"{type(err).__name__}: {err}"), err

    async def _decide(self, number: int, res: SaveResult, part: RankPart
                      ) -> tuple[Outcome, VersionManifest | None]:
        """Gather every rank's part; rank 0 commits or not; every rank learns the outcome."""
        ctx, coord = self.ctx, self.ctx.coordinator
        try:
            parts = await coord.gather_parts(part)
        except DistributedError:  # a peer died or hung before any commit: drop our blobs
            await asyncio.shield(ctx.discard(number))
            raise
        outcome: Outcome | None = None
        manifest: VersionManifest | None = None
        if parts is not None:  # rank 0 decides
            try:
                outcome, manifest = await self.version.commit(number, res, parts,
                                                              self._metrics)
            except asyncio.CancelledError:  # cancelled while committing: publish nothing
                await asyncio.shield(ctx.discard(number))
                raise
        return await coord.broadcast_outcome(outcome), manifest

    async def _failed(self, number: int, res: SaveResult, outcome: Outcome,
                      local_err: BaseException | None) -> NoReturn:
        """Record the failure, remove what was written, raise the save's error."""
        ctx = self.ctx
        res.status, res.error = "failed", outcome.error
        res.total_s = time.perf_counter() - self.t0
        ctx.history.append(res)
        log.error("save of step %d (%s) failed: %s", res.step, res.version_id, outcome.error)
        if not outcome.claim_lost:  # a lost claim's folder may be another writer's now
            await asyncio.shield(ctx.discard(number))
        local_err = local_err or self.version.error
        if outcome.nonfinite and local_err is None:  # refused for NaN/Inf: the same error
            local_err = NonFiniteState(outcome.error or "NaN/Inf", outcome.nonfinite)
        if local_err is not None and (ctx.world_size == 1
                                      or isinstance(local_err, NonFiniteState)):
            raise local_err
        raise DistributedError(outcome.error or "save failed")

    async def _committed(self, number: int, res: SaveResult, part: RankPart,
                         updates: list[_ChainUpdate], outcome: Outcome,
                         manifest: VersionManifest | None) -> None:
        """The version is committed: chains and lossy track move on, rank 0 publishes."""
        ctx = self.ctx
        if ctx.steps is not None:
            ctx.steps.add(res.step)
        for chain, idx, ref, plan, hashes, names, counts in updates:
            commit_item(chain, idx, version_id(number), ref, plan, hashes, names, counts)
        if ctx.lossy is not None and part.lossy is not None:
            mine = part.lossy.shards[0]
            ctx.lossy.commit(BaseRef(version_id=version_id(number), key=mine.key,
                                     xxh64=mine.xxh64))
            if self._lossy_restart:  # its reconstruction holds NaN/Inf: no delta base
                ctx.lossy.reset()
        if manifest is not None:
            await self.version.after_commit(manifest, outcome.manifest_key or "")
        res.status = "committed"
        res.total_s = time.perf_counter() - self.t0
        res.host_peak_bytes = ctx.memory.peak
        ctx.history.append(res)
        log.info("%s", res.line())
        if ctx.on_save is not None:
            ctx.on_save(res)

    # ------------------------------------------------------------ encode and write
    async def _write_part(self, number: asyncio.Future[int], res: SaveResult,
                          updates: list[_ChainUpdate]) -> RankPart:
        """Write this rank's blobs and RNG file durably; report what was written.

        ``number`` is the version number being agreed: blobs start encoding before it is
        known (their keys wait for it). ``updates`` receives the chain bookkeeping to apply
        once the version commits.
        """
        ctx = self.ctx
        part = RankPart(rank=ctx.rank)
        items = self.snap.items()
        if ctx.lossy is not None:
            items = await self._write_lossy(await _agreed(number), items, part)
        rng_file = self._rng_file(part, res)
        # items (and the RNG file) are written concurrently: one blob's fsync waits on the
        # disk while the codec threads encode the next one
        written = await all_or_first_error(
            [self._write_item(item, number, res, updates) for item in items]
            + [self._write_rng(rng_file, number, part)])
        for out in written[:len(items)]:
            if out is not None:
                self._report(part, *out)
        res.bytes_in += part.bytes_in
        res.bytes_out += part.bytes_out
        return part

    async def _key_of(self, name: str, number: asyncio.Future[int]) -> str:
        n = await _agreed(number)
        if self.ctx.whole_model(name) and self.ctx.rank == 0:
            return self.ctx.layout.model_key(n, self.ctx.encoder.model_ext)
        return self.ctx.layout.shard_key(n, name, self.ctx.rank)

    async def _write_item(self, item: StagedItem, number: asyncio.Future[int],
                          res: SaveResult, updates: list[_ChainUpdate]
                          ) -> tuple[StagedItem, BlobRef] | None:
        """Plan (delta chains) and write one item's blob; None if another rank writes it."""
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        chain = ctx.chains[item.name]
        plan, hashes = (await loop.run_in_executor(ctx.pool, plan_item, chain, item.tensors)
                        if ctx.chain_policy.double_buffer and item.stream is None
                        else (EncodePlan(), {}))
        if ctx.whole_model(item.name) and ctx.rank != 0:
            return None
        key = asyncio.ensure_future(self._key_of(item.name, number))
        try:
            ref = await ctx.encoder.write(ctx.store, key, item, step=res.step, plan=plan)
        finally:
            key.cancel()  # no-op once done; stops a key still waiting when writing failed
        gone = await ctx.catalog.missing_bases(depends_on([ref]))
        if gone:  # another process's retention deleted a base meanwhile: keyframe instead
            log.warning("%s: base %s was deleted by another process; writing a keyframe",
                        ref.key, ", ".join(sorted({b.version_id for b in gone})))
            chain.reset()
            plan, hashes = await loop.run_in_executor(ctx.pool, plan_item, chain, item.tensors)
            ref = await ctx.encoder.write(ctx.store, ref.key, item, step=res.step, plan=plan)
        ref = self._allowed(ref)
        if item.stream is None:  # a streamed keyframe leaves no base behind
            prefix = f"{item.name}/"
            counts = {full.removeprefix(prefix): (c.nan, c.inf)
                      for full, c in ref.nonfinite.items()}
            updates.append((chain, item.area_idx, ref, plan, hashes, list(item.tensors),
                            counts))
        return item, ref

    def _allowed(self, ref: _Ref) -> _Ref:
        """``ref`` with its NaN/Inf counts of tensors ``nonfinite_allow`` matches marked."""
        if not ref.nonfinite:
            return ref
        return ref.model_copy(update={"nonfinite": mark_allowed(
            ref.nonfinite, self.ctx.config.checkpointing.nonfinite_allow)})

    def _rng_file(self, part: RankPart, res: SaveResult) -> bytes:
        """This rank's RNG file: RNG states and the JSON states (``exact`` says whether
        every one of them resumes exactly)."""
        states = self.snap.json_states
        part.exact = all(not isinstance(s, dict) or s.get("exact", True) is not False
                         for s in states.values())
        doc = {"rank": self.ctx.rank, "step": res.step, "rng": self.snap.rng,
               "states": states, "exact": part.exact}
        data = json.dumps(doc).encode()
        part.rng_xxh64 = xxhash.xxh64_hexdigest(data)
        return data

    async def _write_rng(self, data: bytes, number: asyncio.Future[int],
                         part: RankPart) -> None:
        part.rng_key = self.ctx.layout.rng_key(await _agreed(number), self.ctx.rank)
        await self.ctx.store.put(part.rng_key, data)
        part.rng_bytes = len(data)

    def _report(self, part: RankPart, item: StagedItem, ref: BlobRef) -> None:
        """Record one written blob in this rank's part (the model, or a shard)."""
        part.bytes_in += ref.raw_bytes
        part.bytes_out += ref.bytes
        if self.ctx.whole_model(item.name) and self.ctx.rank == 0:
            part.model = ref
            return
        pieces = {n: p for n, p in self.snap.pieces.get(item.name, {}).items()
                  if n in item.tensors}
        part.shards[item.name] = ShardRef(rank=self.ctx.rank, pieces=pieces,
                                          **ref.model_dump())

    async def _write_lossy(self, number: int, items: list[StagedItem],
                           part: RankPart) -> list[StagedItem]:
        """Encode and store this rank's lossy blob; return the items without its tensors.

        Only the rank-0 model is coded lossily when the model is not sharded (as for the
        lossless model blob); the staged buffers are read, never changed."""
        ctx = self.ctx
        assert ctx.lossy is not None
        roles = self.snap.roles
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
        # NaN/Inf of the values themselves, before they are quantised
        counts = await loop.run_in_executor(ctx.pool, count_tensors, lossy_state)
        if counts:  # NaN/Inf cannot be quantised: those groups are stored exactly
            bad = {roles[n][0] for n in counts}
            roles = {n: r for n, r in roles.items() if r[0] not in bad}
            self._lossy_restart = True
            log.warning("rank %d: NaN/Inf in lossy tensors (%s): stored exactly in this "
                        "version, and the lossy chain restarts at the next one", ctx.rank,
                        ", ".join(sorted(counts)))
        ckpt = await loop.run_in_executor(ctx.pool, ctx.lossy.encode, lossy_state, roles)
        from mithril_async.pipeline.lossy import write_lossy  # torch: a lossy tier's only
        shard = await write_lossy(ctx.store, ctx.layout.lossy_key(number, ctx.rank), ckpt,
                                  ctx.lossy.base, ctx.rank, ctx.pool,
                                  ctx.config.checkpointing.lossy.level)
        shard = self._allowed(shard.model_copy(update={"nonfinite": counts}))
        part.lossy = ctx.lossy.entry(ckpt, shard)
        part.bytes_in += shard.raw_bytes
        part.bytes_out += shard.bytes
        return rest


async def _agreed(number: asyncio.Future[int]) -> int:
    """The agreed version number; shielded: a failed write must not cancel the agreement."""
    return await asyncio.shield(number)


def _trainer_snapshot(ctx: SaveContext, on_now: Callable[[], None]) -> StateSnapshot:
    """A snapshot of the live state (imported here: it needs torch, which a checkpoint
    worker, whose snapshots are handed to it, never loads)."""
    from mithril_async.save.trainer_snapshot import TrainerSnapshot

    return TrainerSnapshot(ctx, on_now)
