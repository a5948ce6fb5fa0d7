"""Encode one staged state item into one blob streamed to a Store.

Compression on: an MCKP blob (docs/FORMAT.md), its chunks encoded on the codec pool while
finished ones are appended to the store's streaming writer (:mod:`~mithril_async.save.chunks`).
Compression off: a plain ``.safetensors`` file streamed straight from the staging buffers.
Either way the state tree's non-tensor skeleton travels in the blob's metadata, and the blob's
xxhash64 goes into the manifest.

Every byte a writer holds is taken from the host budget first, as
:class:`~mithril_async.memory.budget.EncodeBudget` reckons it (a blob's admission, then two
chunks per chunk in flight until written), so ``host_memory_mib`` is a hard cap and each save
can report its peak. An item streamed under that budget (``StagedItem.stream``) has no staged
copy: each chunk is copied out of the live tensor into a ring slot right before it is encoded
(:class:`~mithril_async.save.stream_snapshot.StreamSnapshot`), and the blob is byte for byte
what the staged path writes.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import xxhash

from mithril_async.codec import kernels as K
from mithril_async.codec.chunk import CodecParams, EncodedChunk
from mithril_async.codec.container import MckpWriter, TensorEntry
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.safetensors_io import safetensors_header
from mithril_async.config import CompressionConfig, PipelineConfig, check_host_memory
from mithril_async.manifest import BlobRef
from mithril_async.memory.budget import BlobDemand, EncodeBudget, HostBudget
from mithril_async.pipeline.blobs import ITEM_KEY, REFS_KEY, SKELETON_KEY
from mithril_async.pipeline.loop import lower_priority
from mithril_async.pipeline.pool import CodecPool
from mithril_async.save.chunks import ChunkJob, ChunkRun, batch_jobs
from mithril_async.save.items import U8, EncodePlan, StagedItem, StreamedTensor
from mithril_async.save.nonfinite import named
from mithril_async.storage.base import BlobWriter, Store
from mithril_async.storage.deferred import DeferredWriter

__all__ = ["MIN_AUTO_CHUNK", "BlobEncoder"]

#: smallest chunk size ``auto_chunk`` picks for a small blob
MIN_AUTO_CHUNK = 1 << 20
#: pieces of an uncompressed blob smaller than this are hashed on the event loop's thread
#: (a hop to a pool thread costs more than hashing them)
_INLINE_HASH_BYTES = 256 << 10

#: per tensor of a blob: its (NaNs, Infs), filled in as the blob is written
Tallies = dict[str, list[int]]


def _hash_and_count(h: xxhash.xxh64, piece: memoryview, tally: K.NonFiniteTally | None
                    ) -> None:
    """Hash ``piece`` into ``h`` and count its NaN/Inf elements into ``tally`` (an element
    aligned piece), a cache-sized run at a time: the count reads what the hash just read."""
    if tally is None:
        h.update(piece)
    else:
        K.count_nonfinite_after(piece, tally, h.update)


class BlobEncoder:
    """Turns staged items into blobs, as the config says, on the codec ``pool``."""

    def __init__(self, comp: CompressionConfig, pipe: PipelineConfig, pool: CodecPool) -> None:
        check_host_memory(comp, pipe)
        self.comp = comp
        self.pipe = pipe
        self.pool = pool
        self.params = CodecParams(level=comp.level, byte_grouping=comp.byte_grouping,
                                  chunk_bytes=max(1, int(comp.chunk_mib * (1 << 20))))
        #: what encoding takes of the host memory (host_memory_mib), and when
        self.budget = EncodeBudget(pipe, pool.threads, self.params.chunk_bytes, comp.enabled)
        #: streamed saves encode on this many threads of their own (``lanes``), so the codec
        #: threads' own buffers stay within the budget whatever the pool's size
        self._lanes: CodecPool | None = None

    @property
    def memory(self) -> HostBudget:
        """The account every byte of a save is taken from."""
        return self.budget.host

    @property
    def threads(self) -> int:
        return self.pool.threads

    def lanes(self, n: int) -> CodecPool:
        """The ``n`` codec threads of streamed saves (made again when ``n`` changes)."""
        if self._lanes is None or self._lanes.threads != n:
            if self._lanes is not None:
                self._lanes.shutdown(wait=False)
            self._lanes = CodecPool(n, "mithril-stream", initializer=lower_priority,
                                    initargs=(self.pipe.background_nice,))
            # the manager closes its pool, not ours: ours goes with the encoder
            weakref.finalize(self, self._lanes.shutdown, wait=False)
        return self._lanes

    def params_for(self, nbytes: int) -> CodecParams:
        """The codec parameters for a blob of ``nbytes`` raw bytes.

        With ``auto_chunk`` a blob smaller than 32 configured chunks gets chunks of 1/32 of its
        size (at least :data:`MIN_AUTO_CHUNK`): the codec's working set (per-thread scratch,
        encoded chunks in flight) follows the chunk size, and a small state should not pay a
        full chunk per thread. The blob header records the chunk size it was written with.
        """
        cb = self.params.chunk_bytes
        if not self.comp.auto_chunk or nbytes >= 32 * cb:
            return self.params
        small = max(MIN_AUTO_CHUNK, nbytes // 32)
        return self.params if small >= cb else replace(self.params, chunk_bytes=small)

    def demand(self, item: StagedItem) -> BlobDemand:
        """What the budget needs to know of ``item``'s blob before it exists: its chunk size
        and an estimate of its header (skeleton JSON, a few hundred bytes per chunk)."""
        params = self.params_for(item.nbytes)
        header = (len(json.dumps(item.skeleton, separators=(",", ":"))) + 4096
                  + 256 * sum(1 + t.numel() * t.element_size() // params.chunk_bytes
                              for t in item.tensors.values()))
        return BlobDemand(params, header, item.stream is not None)

    @property
    def model_ext(self) -> str:
        return "mckp" if self.comp.enabled else "safetensors"

    def describe(self) -> dict[str, Any]:
        """What the manifest records about how blobs were made."""
        if not self.comp.enabled:
            return {"format": "safetensors"}
        return {"format": "mckp", **self.params.to_dict()}

    async def write(self, store: Store, key: str | asyncio.Future[str], item: StagedItem, *,
                    step: int, plan: EncodePlan | None = None) -> BlobRef:
        """Encode ``item`` into one blob under ``key`` and commit it.

        ``key`` may be a future (the version number is still being agreed): encoding starts
        at once and what it writes first waits in memory for the key, up to the in-flight
        budget (:class:`~mithril_async.storage.deferred.DeferredWriter`).
        """
        plan = plan or EncodePlan()
        blob = self.demand(item)
        writer: BlobWriter = (store.open_writer(key) if isinstance(key, str) else
                              DeferredWriter(store, key, limit=self.budget.deferred_limit(blob)))
        # what the writer may buffer, held from the budget while the blob is written
        hold = self.budget.writer_hold(blob, key_known=isinstance(key, str))
        tallies: Tallies = {}
        try:
            if self.comp.enabled:
                digest = await self._write_mckp(writer, item, step, plan, hold, tallies)
                fmt = "mckp"
            else:
                digest = await self._write_safetensors(writer, item, hold, tallies)
                fmt = "safetensors"
            size = await writer.commit()
        except BaseException:
            await asyncio.shield(writer.abort())
            raise
        holders = {(r.holder.key, r.holder.xxh64): r.holder for r in plan.refs.values()}
        # referenced tensors are the base's bytes: they keep the base's counts
        counted = {**tallies, **{n: list(c) for n, c in plan.nonfinite.items()}}
        return BlobRef(key=writer.key, bytes=size, xxh64=digest, format=fmt,
                       raw_bytes=item.nbytes, base=plan.base if plan.base_views else None,
                       refs=sorted(holders.values(), key=lambda b: b.key),
                       nonfinite=named(item.name, counted))

    def _metadata(self, item: StagedItem, plan: EncodePlan | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {SKELETON_KEY: json.dumps(item.skeleton, separators=(",", ":")),
                                ITEM_KEY: item.name}
        if plan is not None and plan.refs:
            meta[REFS_KEY] = {name: r.to_json() for name, r in plan.refs.items()}
        return meta

    async def _write_safetensors(self, writer: BlobWriter, item: StagedItem, hold: int,
                                 tallies: Tallies) -> str:
        header = safetensors_header(item.tensors, self._metadata(item))
        admit = self.budget.header_admission(hold, len(header))
        await self.memory.acquire(admit, f"{item.name}: its blob header "
                                  f"({len(header)} bytes) and write buffers")
        try:
            return await self._safetensors_body(writer, item, header, tallies)
        finally:
            self.memory.release(admit)

    async def _safetensors_body(self, writer: BlobWriter, item: StagedItem,
                                header: bytes, tallies: Tallies) -> str:
        h = xxhash.xxh64()
        h.update(header)
        await writer.write(header)
        loop = asyncio.get_running_loop()
        step = self.params.chunk_bytes
        if item.stream is not None:
            await self._stream_safetensors(writer, item, h, tallies)
            return h.hexdigest()
        for name, t in item.tensors.items():
            view, dtype, _ = tensor_bytes(t)
            tally = K.NonFiniteTally.of(dtype)
            n = step - step % tally.width if tally is not None else step  # whole elements
            for off in range(0, view.size, n):
                piece = memoryview(view[off:off + n].data)
                if piece.nbytes < _INLINE_HASH_BYTES:
                    _hash_and_count(h, piece, tally)
                    await writer.write(piece)
                else:  # hash on the pool while the writer writes the same bytes
                    await asyncio.gather(
                        loop.run_in_executor(self.pool, _hash_and_count, h, piece, tally),
                        writer.write(piece))
            if tally is not None:
                tallies[name] = [tally.nan, tally.inf]
        return h.hexdigest()

    async def _stream_safetensors(self, writer: BlobWriter, item: StagedItem,
                                  h: xxhash.xxh64, tallies: Tallies) -> None:
        """The tensor bytes of a streamed item, in file order, each piece copied out into a
        ring slot, hashed (and its NaN/Inf counted) and written before the slot is reused."""
        assert item.stream is not None and item.ring is not None
        loop = asyncio.get_running_loop()
        for name in item.tensors:
            st = item.stream[name]
            tally = K.NonFiniteTally.of(st.dtype)
            step = min(self.params.chunk_bytes, item.ring.slot_bytes)
            if tally is not None:
                step -= step % tally.width  # pieces of whole elements
            for off in range(0, st.nbytes, step):
                n = min(step, st.nbytes - off)
                lease = await item.ring.acquire(st.later)
                try:
                    pool = self._lanes or self.pool
                    piece = (await loop.run_in_executor(pool, st.fetch, lease, off, n)).data
                    await loop.run_in_executor(pool, _hash_and_count, h, piece, tally)
                    await writer.write(piece)
                finally:
                    lease.release()
            if tally is not None:
                tallies[name] = [tally.nan, tally.inf]

    def _mckp_layout(self, item: StagedItem, plan: EncodePlan, params: CodecParams
                     ) -> tuple[list[U8 | StreamedTensor], list[U8 | None], list[TensorEntry],
                                list[ChunkJob]]:
        """Per tensor stored in the blob (not only referenced): its bytes (or its streamed
        source), its delta base's bytes, its index entry; and every chunk to encode."""
        views: list[U8 | StreamedTensor] = []
        bases: list[U8 | None] = []
        entries: list[TensorEntry] = []
        jobs: list[ChunkJob] = []
        for name, t in item.tensors.items():
            if name in plan.refs:
                continue
            ti = len(entries)
            view: U8 | StreamedTensor
            if item.stream is not None:  # copied out chunk by chunk as it is encoded
                view = item.stream[name]
                dtype_name, shape = view.dtype, view.shape
            else:
                view, dtype_name, shape = tensor_bytes(t, where=name)
            base = plan.base_views.get(name)
            base_hash = None if base is None else xxhash.xxh64_intdigest(base.data)
            entry = TensorEntry.make(name, dtype_name, shape, params.chunk_bytes, base_hash)
            views.append(view)
            bases.append(base)
            entries.append(entry)
            jobs.extend((ti, ci, off, n) for ci, (off, n) in enumerate(entry.chunks))
        return views, bases, entries, jobs

    async def _write_mckp(self, writer: BlobWriter, item: StagedItem, step: int,
                          plan: EncodePlan, hold: int, tallies: Tallies) -> str:
        params = self.params_for(item.nbytes)
        views, bases, entries, jobs = self._mckp_layout(item, plan, params)
        if item.stream is not None:  # what save() waits for is copied out first
            jobs.sort(key=lambda j: _later(views[j[0]]))
            batches = [[j] for j in jobs]  # each chunk takes its own ring slot
        else:
            batches = batch_jobs(jobs, params.chunk_bytes)
        mckp = MckpWriter(entries, params=params, training_step=step,
                          previous_checkpoint_hash=plan.base.xxh64 if plan.base_views and
                          plan.base else None, metadata=self._metadata(item, plan))
        head = mckp.begin()
        # admitted as a whole, so no blob ever waits for budget while holding part of it
        admit, floor = self.budget.chunked_admission(hold, len(head), len(jobs), params)
        await self.memory.acquire(admit, f"{item.name}: its blob header ({len(head)} bytes: "
                                  "the state's non-tensor values and tensor index), write "
                                  "buffers and one chunk in flight")
        counts = [[0, 0] for _ in entries]  # per stored tensor, from its chunks' counts

        def sink(ti: int, ci: int, enc: EncodedChunk) -> Awaitable[None]:
            c = counts[ti]
            c[0] += enc.nonfinite[0]
            c[1] += enc.nonfinite[1]
            return writer.write(mckp.add(ti, ci, enc))

        try:
            await writer.write(head)
            del head
            extra = {"floor": floor} if floor else {}
            await self._run_chunks(batches, views, bases, entries, params, sink, **extra)
            await writer.write(mckp.finish())
            tallies.update((e.name, c) for e, c in zip(entries, counts, strict=True))
        finally:
            self.memory.release(admit)
        return f"{mckp.xxh64:016x}"

    async def _run_chunks(
        self,
        jobs: list[list[ChunkJob]],
        views: list[U8 | StreamedTensor],
        bases: list[U8 | None],
        entries: list[TensorEntry],
        params: CodecParams,
        sink: Callable[[int, int, EncodedChunk], Awaitable[None]],
        *,
        floor: int = 0,
    ) -> None:
        """Encode the chunk batches ``jobs`` on the pool, at most the encode window of them
        in flight, handing each to ``sink`` as it finishes (see
        :class:`~mithril_async.save.chunks.ChunkRun`). ``floor``: budget this blob already
        holds for one chunk in flight."""
        run = ChunkRun(views, bases, entries, params, sink, self.budget.window(params, floor),
                       self.pool, self._lanes)
        await run.run(jobs)


def _later(view: U8 | StreamedTensor) -> bool:
    return isinstance(view, StreamedTensor) and view.later
