"""Encode a staged state item into one blob streamed to a Store, and decode it back.

Compression on: an MCKP blob (docs/FORMAT.md). The tensors are cut into chunks; chunks are
encoded on the codec thread pool (native transforms + zstd, GIL released) while finished chunks
are appended to the store's streaming writer in completion order, so transform, entropy coding
and I/O overlap. Encoded bytes in flight are bounded by ``max_inflight_mib`` (back-pressure is
the memory bound). Compression off: a plain ``.safetensors`` file streamed straight from the
staging buffers. Either way the state tree's non-tensor skeleton travels in the blob's metadata,
and the blob's xxhash64 goes into the manifest.

Every byte the codec holds is taken from the manager's :class:`HostBudget` first (codec
scratch and the encoded chunk until written: two chunks per chunk in flight; the store
writer's buffers; a blob's header), so ``host_memory_mib`` is a hard cap and ``SaveResult``
can report the peak. An item streamed under that budget (``StagedItem.stream``) has no
staged copy: each chunk is copied out of the live tensor into a ring slot right before it is
encoded (:class:`~mithril_async.pipeline.stager.StreamSnapshot`), and the blob is byte for
byte what the staged path writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import safetensors.torch
import torch
import xxhash

from mithril_async.codec.chunk import (
    BATCH_CHUNK_BYTES,
    CodecParams,
    EncodedChunk,
    encode_chunk,
    encode_chunks,
)
from mithril_async.codec.container import BlockRef, MckpInfo, MckpWriter, TensorEntry
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.safetensors_io import safetensors_header
from mithril_async.codec.state_dict import decode_tensors, read_info
from mithril_async.config import CompressionConfig, PipelineConfig, check_host_memory
from mithril_async.errors import ChecksumMismatch, InvalidFormat, MissingPrevious
from mithril_async.manifest import BaseRef, BlobRef
from mithril_async.memory.budget import HostBudget
from mithril_async.memory.ring import SlotLease, SlotRing
from mithril_async.pipeline.partial import read_partial
from mithril_async.save.stream import StreamedTensor
from mithril_async.storage.base import BlobWriter, Store
from mithril_async.storage.deferred import DeferredWriter

SKELETON_KEY = "mithril.skeleton"
ITEM_KEY = "mithril.item"
REFS_KEY = "mithril.refs"
#: blob formats :meth:`BlobCodec.read` decodes; the lossy tier's "mldc" is read by
#: pipeline/lossy.py, so this module never depends on :mod:`mithril_async.lossy`
LOSSLESS_FORMATS = ("mckp", "safetensors")
#: smallest chunk size ``auto_chunk`` picks for a small blob
MIN_AUTO_CHUNK = 1 << 20

U8 = np.ndarray[Any, np.dtype[np.uint8]]
#: a finished pool task of :meth:`BlobCodec._run_chunks`: its raw bytes and its blocks
_Done = tuple[int, list[tuple[int, int, EncodedChunk]]]


@dataclass(frozen=True)
class TensorRef:
    """Where a full copy of a tensor lives: tensor ``name`` inside blob ``holder``."""

    holder: BaseRef
    name: str
    xxh64: int  # of the tensor's raw bytes

    def to_json(self) -> dict[str, Any]:
        return {"version_id": self.holder.version_id, "key": self.holder.key,
                "blob_xxh64": self.holder.xxh64, "name": self.name,
                "xxh64": f"{self.xxh64:016x}"}

    @classmethod
    def from_json(cls, d: Any, where: str) -> TensorRef:
        try:
            return cls(BaseRef(version_id=d["version_id"], key=d["key"], xxh64=d["blob_xxh64"]),
                       str(d["name"]), int(d["xxh64"], 16))
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidFormat(f"{where}: malformed tensor reference ({err})") from None


@dataclass
class EncodePlan:
    """How to encode one item: which tensors are deltas against ``base``, which are refs."""

    base: BaseRef | None = None
    base_views: dict[str, U8] = field(default_factory=dict)
    refs: dict[str, TensorRef] = field(default_factory=dict)


#: resolves a blob (by BaseRef) to its decoded tensors; supplied by the manager
#: ``load_blob(base, names)``: the tensors ``names`` of the blob ``base`` names, decoded and
#: verified (at least those; the loader may cache and return more)
LoadBlob = Callable[[BaseRef, frozenset[str]], Awaitable[dict[str, torch.Tensor]]]


@dataclass
class StagedItem:
    """One stateful object's snapshot: its tree skeleton and its staged tensors."""

    name: str
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    #: which of the item's staging buffer sets holds ``tensors`` (double-buffered chains)
    area_idx: int = 0
    #: streamed under host_memory_mib: ``tensors`` are the live ones, copied out chunk by
    #: chunk through ``ring`` (see StreamSnapshot); None: ``tensors`` are staged copies
    stream: dict[str, StreamedTensor] | None = None
    ring: SlotRing | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


#: pieces of an uncompressed blob smaller than this are hashed on the event loop's thread
_INLINE_HASH_BYTES = 256 << 10


class _Budget:
    """A byte budget for data in flight between encoder threads and the store."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit


def thread_scratch(chunk_bytes: int) -> int:
    """Host memory one codec thread keeps between chunks (codec/chunk.py's transform
    scratch, the rANS output buffer, a zstd context): about two chunks plus 2 MiB."""
    return 2 * chunk_bytes + (2 << 20)


#: what a store's blob writer may buffer (LocalStore coalesces writes up to 1 MiB); S3 adds
#: its part buffers (SaveContext sets :attr:`BlobCodec.write_buffer_bytes`)
WRITE_BUFFER_BYTES = 1 << 20


class BlobCodec:
    """Turns staged items into blobs and back, as the config says."""

    def __init__(self, comp: CompressionConfig, pipe: PipelineConfig, pool: Executor) -> None:
        check_host_memory(comp, pipe)
        self.comp = comp
        self.pipe = pipe
        self.pool = pool
        self.params = CodecParams(level=comp.level, byte_grouping=comp.byte_grouping,
                                  chunk_bytes=max(1, int(comp.chunk_mib * (1 << 20))))
        #: the pipeline's account of the host memory it holds (host_memory_mib)
        self.memory = HostBudget(None if pipe.host_memory_mib is None
                                 else pipe.host_memory_mib << 20)
        self.write_buffer_bytes = WRITE_BUFFER_BYTES
        #: streamed saves encode on this many threads of their own (``lanes``), so the codec
        #: threads' own buffers stay within the budget whatever the pool's size
        self._lanes: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def threads(self) -> int:
        return int(getattr(self.pool, "_max_workers", 1) or 1)

    def lanes(self, n: int) -> concurrent.futures.ThreadPoolExecutor:
        """The ``n`` codec threads of streamed saves (made again when ``n`` changes)."""
        from mithril_async.pipeline.loop import lower_priority

        if self._lanes is None or self._lanes._max_workers != n:
            if self._lanes is not None:
                self._lanes.shutdown(wait=False)
            self._lanes = concurrent.futures.ThreadPoolExecutor(
                n, "mithril-stream", initializer=lower_priority,
                initargs=(self.pipe.background_nice,))
            # the manager closes its pool, not ours: ours goes with the codec
            weakref.finalize(self, self._lanes.shutdown, wait=False)
        return self._lanes

    def params_for(self, nbytes: int) -> CodecParams:
        """The codec parameters for a blob of ``nbytes`` raw bytes.

        With ``auto_chunk`` a blob smaller than 32 configured chunks gets chunks of 1/32 of its
        size (at least :data:`MIN_AUTO_CHUNK`): the codec's working set (per-thread scratch,
        encoded chunks in flight) follows the chunk size, and a small state should not pay
        4 MiB per thread.  The blob header records the chunk size it was written with.
        """
        cb = self.params.chunk_bytes
        if not self.comp.auto_chunk or nbytes >= 32 * cb:
            return self.params
        small = max(MIN_AUTO_CHUNK, nbytes // 32)
        return self.params if small >= cb else replace(self.params, chunk_bytes=small)

    def inflight_limit(self, params: CodecParams) -> int:
        """Raw bytes of chunks in flight (submitted, not yet written): ``max_inflight_mib``,
        but never more than two chunks per codec thread (at least 4): the encoders stay busy
        with that, and more only piles up encoded chunks waiting for the writer (a 42 MB
        state's whole blob was in memory at once: peak 1.33x the state)."""
        threads = int(getattr(self.pool, "_max_workers", 1) or 1)
        window = max(4, 2 * threads) * params.chunk_bytes
        return min(self.pipe.max_inflight_mib << 20, window)

    def deferred_limit(self, item: StagedItem) -> int:
        """Bytes a blob writer holds while its key is still being agreed: one chunk when
        streamed under a budget, else the encode window."""
        params = self.params_for(item.nbytes)
        return params.chunk_bytes if item.stream is not None else self.inflight_limit(params)

    def admission(self, item: StagedItem) -> int:
        """What a blob of ``item`` takes from the budget before its first chunk, and holds to
        its end (an estimate before the header exists, exact in :meth:`write`): write buffers,
        its first bytes while the version is agreed, the header twice (it and the writer's
        copy), and one chunk in flight (two chunks: codec scratch, encoded block), so every
        admitted blob can always make progress, whatever the others hold."""
        params = self.params_for(item.nbytes)
        header = 2 * (len(json.dumps(item.skeleton, separators=(",", ":"))) + 4096
                      + 256 * sum(1 + t.numel() * t.element_size() // params.chunk_bytes
                                  for t in item.tensors.values()))
        floor = 2 * params.chunk_bytes if self.comp.enabled else 0
        return self.write_buffer_bytes + self.deferred_limit(item) + header + floor

    def write_reserve(self, item: StagedItem) -> int:
        """The most host memory :meth:`write` takes from the budget for ``item`` besides its
        source tensors: its admission plus two chunks per further chunk in flight."""
        extra = 2 * self.inflight_limit(self.params_for(item.nbytes)) if self.comp.enabled else 0
        return self.admission(item) + extra

    @property
    def model_ext(self) -> str:
        return "mckp" if self.comp.enabled else "safetensors"

    def describe(self) -> dict[str, Any]:
        """What the manifest records about how blobs were made."""
        if not self.comp.enabled:
            return {"format": "safetensors"}
        return {"format": "mckp", **self.params.to_dict()}

    # ------------------------------------------------------------------ write
    async def write(self, store: Store, key: str | asyncio.Future[str], item: StagedItem, *,
                    step: int, plan: EncodePlan | None = None) -> BlobRef:
        """Encode ``item`` into one blob under ``key`` and commit it.

        ``key`` may be a future (the version number is still being agreed): encoding starts
        at once and what it writes first waits in memory for the key, up to the in-flight
        budget (:class:`~mithril_async.storage.deferred.DeferredWriter`).
        """
        plan = plan or EncodePlan()
        writer: BlobWriter = (store.open_writer(key) if isinstance(key, str) else
                              DeferredWriter(store, key, limit=self.deferred_limit(item)))
        # what the writer may buffer, held from the budget while the blob is written
        hold = self.write_buffer_bytes + (0 if isinstance(key, str)
                                          else self.deferred_limit(item))
        try:
            if self.comp.enabled:
                digest = await self._write_mckp(writer, item, step, plan, hold)
                fmt = "mckp"
            else:
                digest = await self._write_safetensors(writer, item, hold)
                fmt = "safetensors"
            size = await writer.commit()
        except BaseException:
            await asyncio.shield(writer.abort())
            raise
        holders = {(r.holder.key, r.holder.xxh64): r.holder for r in plan.refs.values()}
        return BlobRef(key=writer.key, bytes=size, xxh64=digest, format=fmt,
                       raw_bytes=item.nbytes, base=plan.base if plan.base_views else None,
                       refs=sorted(holders.values(), key=lambda b: b.key))

    def _metadata(self, item: StagedItem, plan: EncodePlan | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {SKELETON_KEY: json.dumps(item.skeleton, separators=(",", ":")),
                                ITEM_KEY: item.name}
        if plan is not None and plan.refs:
            meta[REFS_KEY] = {name: r.to_json() for name, r in plan.refs.items()}
        return meta

    async def _write_safetensors(self, writer: BlobWriter, item: StagedItem, hold: int) -> str:
        header = safetensors_header(item.tensors, self._metadata(item))
        admit = hold + 2 * len(header)
        await self.memory.acquire(admit, f"{item.name}: its blob header "
                                  f"({len(header)} bytes) and write buffers")
        try:
            return await self._safetensors_body(writer, item, header)
        finally:
            self.memory.release(admit)

    async def _safetensors_body(self, writer: BlobWriter, item: StagedItem,
                                header: bytes) -> str:
        h = xxhash.xxh64()
        h.update(header)
        await writer.write(header)
        loop = asyncio.get_running_loop()
        step = self.params.chunk_bytes
        if item.stream is not None:
            await self._stream_safetensors(writer, item, h)
            return h.hexdigest()
        for t in item.tensors.values():
            view, _, _ = tensor_bytes(t)
            for off in range(0, view.size, step):
                piece = memoryview(view[off:off + step].data)
                if piece.nbytes < _INLINE_HASH_BYTES:  # a thread hop costs more than this
                    h.update(piece)
                    await writer.write(piece)
                else:  # hash on the pool while the writer writes the same bytes
                    await asyncio.gather(loop.run_in_executor(self.pool, h.update, piece),
                                         writer.write(piece))
        return h.hexdigest()

    async def _stream_safetensors(self, writer: BlobWriter, item: StagedItem,
                                  h: xxhash.xxh64) -> None:
        """The tensor bytes of a streamed item, in file order, each piece copied out into a
        ring slot, hashed and written before the slot is reused."""
        assert item.stream is not None and item.ring is not None
        loop = asyncio.get_running_loop()
        step = min(self.params.chunk_bytes, item.ring.slot_bytes)
        for name in item.tensors:
            st = item.stream[name]
            for off in range(0, st.nbytes, step):
                n = min(step, st.nbytes - off)
                lease = await item.ring.acquire(st.later)
                try:
                    pool = self._lanes or self.pool
                    piece = (await loop.run_in_executor(pool, st.fetch, lease, off, n)).data
                    await loop.run_in_executor(pool, h.update, piece)
                    await writer.write(piece)
                finally:
                    lease.release()

    async def _write_mckp(self, writer: BlobWriter, item: StagedItem, step: int,
                          plan: EncodePlan, hold: int) -> str:
        views: list[U8 | StreamedTensor] = []
        bases: list[U8 | None] = []
        entries: list[TensorEntry] = []
        jobs: list[tuple[int, int, int, int]] = []
        params = self.params_for(item.nbytes)
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
        if item.stream is not None:  # what save() waits for is copied out first
            jobs.sort(key=lambda j: _later(views[j[0]]))
            batches = [[j] for j in jobs]  # each chunk takes its own ring slot
        else:
            batches = batch_jobs(jobs, params.chunk_bytes)
        mckp = MckpWriter(entries, params=params, training_step=step,
                          previous_checkpoint_hash=plan.base.xxh64 if plan.base_views and
                          plan.base else None, metadata=self._metadata(item, plan))
        head = mckp.begin()
        # admitted as a whole (header and its copy in the writer, index, write buffers, one
        # chunk in flight), so no blob ever waits for budget while holding part of it
        floor = 2 * params.chunk_bytes if self.memory.limit is not None else 0
        admit = hold + 2 * len(head) + 64 * len(jobs) + floor
        await self.memory.acquire(admit, f"{item.name}: its blob header ({len(head)} bytes: "
                                  "the state's non-tensor values and tensor index), write "
                                  "buffers and one chunk in flight")
        try:
            await writer.write(head)
            del head
            extra = {"floor": floor} if floor else {}
            await self._run_chunks(batches, views, bases, entries, params,
                                   lambda ti, ci, enc: writer.write(mckp.add(ti, ci, enc)),
                                   **extra)
            await writer.write(mckp.finish())
        finally:
            self.memory.release(admit)
        return f"{mckp.xxh64:016x}"

    async def _run_chunks(
        self,
        jobs: list[list[tuple[int, int, int, int]]],
        views: list[U8 | StreamedTensor],
        bases: list[U8 | None],
        entries: list[TensorEntry],
        params: CodecParams,
        sink: Callable[[int, int, EncodedChunk], Awaitable[None]],
        *,
        floor: int = 0,
    ) -> None:
        """Encode chunks on the pool, at most ``max_inflight_mib`` of them in flight.

        ``jobs``: the chunks ``(tensor, chunk, offset, length)``, in batches; a batch of
        several (small chunks, see :func:`batch_jobs`) is one pool task and one native call
        (``encode_chunks``, the same bytes as ``encode_chunk`` of each), and is accounted as
        one chunk of its total length. Each chunk in flight holds two chunks of the host
        budget (codec scratch, then its encoded block) until written; a streamed tensor's
        chunk also holds a ring slot from its copy-out until it is encoded. ``floor``: budget
        this blob already holds for one chunk in flight; further chunks take budget only if
        it is free now, else this blob writes its own finished chunks first. So a blob never
        waits for budget that other blobs hold while holding some itself: blobs sharing a
        budget cannot deadlock."""
        loop = asyncio.get_running_loop()
        budget = _Budget(self.inflight_limit(params))
        memory = self.memory
        held = 0  # budget this call took beyond the floor (released whatever happens)
        floor_free = floor
        pending: dict[asyncio.Future[_Done],
                      tuple[concurrent.futures.Future[Any], SlotLease | None, bool]] = {}
        # finished encodes arrive here in completion order (asyncio.wait over the whole
        # pending set per drained chunk would cost O(chunks^2) callback bookkeeping)
        finished: asyncio.Queue[asyncio.Future[_Done]] = asyncio.Queue()

        def encode_batch(batch: list[tuple[int, int, int, int]], lease: SlotLease | None
                         ) -> _Done:
            if len(batch) == 1:
                ti, ci, off, n = batch[0]
                return n, [(ti, ci, encode(ti, off, n, lease))]
            items = []
            for ti, _, off, n in batch:
                view, base = views[ti], bases[ti]
                assert not isinstance(view, StreamedTensor)  # streamed chunks go one by one
                items.append((view[off:off + n], entries[ti].dtype,
                              None if base is None else base[off:off + n]))
            encs = encode_chunks(items, params)
            return (sum(j[3] for j in batch),
                    [(ti, ci, enc) for (ti, ci, _, _), enc in zip(batch, encs, strict=True)])

        def encode(ti: int, off: int, n: int, lease: SlotLease | None) -> EncodedChunk:
            view = views[ti]
            try:
                if isinstance(view, StreamedTensor):
                    assert lease is not None
                    src = view.fetch(lease, off, n)
                else:
                    src = view[off:off + n]
                base = bases[ti]
                enc = encode_chunk(src, entries[ti].dtype,
                                   None if base is None else base[off:off + n], params)
                if lease is not None:  # a plane stored raw may be a view of the slot
                    enc = EncodedChunk(enc.meta, tuple(
                        p.tobytes() if isinstance(p, np.ndarray) else p for p in enc.parts))
                return enc
            finally:
                if lease is not None:  # encoded: the slot may take the next chunk
                    lease.release()

        async def drain_one() -> bool:
            nonlocal held, floor_free
            if not pending:
                return False
            fut = await finished.get()
            _, _, from_floor = pending.pop(fut)
            n, blocks = fut.result()
            for ti, ci, enc in blocks:
                await sink(ti, ci, enc)
            budget.used -= n
            if from_floor:
                floor_free += 2 * n
            else:
                memory.release(2 * n)
                held -= 2 * n
            return True

        try:
            for batch in jobs:
                ti = batch[0][0]
                n = sum(j[3] for j in batch)
                while not budget.fits(n):
                    await drain_one()
                while True:  # two chunks of budget: the floor, free budget, or our own drain
                    from_floor = floor_free >= 2 * n
                    if from_floor:
                        floor_free -= 2 * n
                        break
                    if memory.try_take(2 * n):
                        held += 2 * n
                        break
                    if not await drain_one():  # nothing of ours in flight, no floor
                        await memory.acquire(2 * n, f"a chunk of {entries[ti].name!r}")
                        held += 2 * n
                        break
                budget.used += n
                view = views[ti]
                lease = (await view.snap.ring.acquire(view.later)
                         if isinstance(view, StreamedTensor) else None)
                cf = (self._lanes or self.pool).submit(encode_batch, batch, lease) \
                    if lease is not None else self.pool.submit(encode_batch, batch, lease)
                fut = asyncio.wrap_future(cf, loop=loop)
                fut.add_done_callback(finished.put_nowait)
                pending[fut] = (cf, lease, from_floor)
            while pending:
                await drain_one()
        finally:
            for fut, (cf, lease, _) in pending.items():
                if cf.cancel() and lease is not None:  # never started: its slot is free
                    lease.release()
                fut.cancel()
            memory.release(held)

    # ------------------------------------------------------------------ read
    async def read(self, store: Store, ref: BlobRef, load_blob: LoadBlob | None = None,
                   only: frozenset[str] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
        """Fetch, verify and decode one blob; return (skeleton, tensors).

        Delta bases and referenced tensors are fetched through ``load_blob``, asking a base
        only for the tensors this blob's deltas need (a version whose AdamW moments were
        stored in full decodes no moment of its base).  ``only``: decode just these tensors;
        when their blocks are a small part of the blob only they are read (ranged reads,
        :mod:`~mithril_async.pipeline.partial`), else the whole blob is read and hashed.

        What the blob says it decodes to is checked against the manifest's ``raw_bytes``
        before anything is allocated (a few hundred bytes of MCKP can legitimately declare a
        GiB of zeros), and what it did decode to after: a blob whose claims do not add up is
        :class:`InvalidFormat`.
        """
        opened = await self._open(store, ref, only)
        if not isinstance(opened, _Opened):
            return opened  # safetensors: (skeleton, tensors), decoded whole
        tensors = await self._decode(ref, opened, load_blob, only)
        if only is None:
            _check_raw_bytes(ref, _nbytes(tensors.values()))
        return skeleton_of(opened.info.metadata, ref.key), tensors

    async def read_each(self, store: Store, ref: BlobRef, new_loader: Callable[[], LoadBlob],
                        ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every tensor of blob ``ref``, verified as :meth:`read` verifies, one at a time.

        For checking a blob without holding it decoded (``mithril verify``): each tensor is
        decoded alone and may be dropped before the next, and each gets a fresh loader from
        ``new_loader()``, so the bases it needed are dropped with it: memory stays at the
        blob's bytes plus one tensor (and that tensor along its delta chain).
        """
        opened = await self._open(store, ref, None)
        if not isinstance(opened, _Opened):
            _check_raw_bytes(ref, _nbytes(opened[1].values()))
            for item in opened[1].items():
                yield item
            return
        skeleton_of(opened.info.metadata, ref.key)  # a blob that restores must have one
        total = 0
        for name in [*(t.name for t in opened.info.tensors), *opened.refs]:
            tensor = (await self._decode(ref, opened, new_loader(), frozenset((name,))))[name]
            total += _nbytes((tensor,))
            yield name, tensor
        _check_raw_bytes(ref, total)

    async def _open(self, store: Store, ref: BlobRef, only: frozenset[str] | None
                    ) -> _Opened | tuple[Any, dict[str, torch.Tensor]]:
        """Fetch and check what :meth:`read` needs before decoding: the blob's size and hash
        (or, for a part of it, each piece's), its header, index and tensor references, and
        that its header claims no more raw bytes than the manifest records. A safetensors
        blob is decoded here, whole: (skeleton, tensors)."""
        if ref.format not in LOSSLESS_FORMATS:
            # lossy (MLDC) blobs decode only along their chain, in pipeline/lossy.py
            # (read_lossy_chain; read_lossy_blob checks one): this codec stays lossless
            raise InvalidFormat(f"{ref.key}: a {ref.format!r} blob, not one this codec reads "
                                f"({', '.join(LOSSLESS_FORMATS)})")
        size = await store.size(ref.key)  # before reading: a huge file costs no memory
        if size != ref.bytes:
            raise InvalidFormat(f"{ref.key}: {size} bytes, manifest says {ref.bytes}")
        loop = asyncio.get_running_loop()
        part = (await read_partial(store, ref.key, size, only)
                if only is not None and ref.format == "mckp" else None)
        if part is not None:  # some tensors of a base: ranged reads, every piece hashed
            info, block_bytes = part
            verify_blocks = True
        else:
            data = await store.get(ref.key)
            if len(data) != ref.bytes:
                raise InvalidFormat(f"{ref.key}: {len(data)} bytes, manifest says {ref.bytes}")
            digest = await loop.run_in_executor(self.pool, xxhash.xxh64_hexdigest, data)
            if digest != ref.xxh64:
                raise ChecksumMismatch(ref.key, ref.xxh64, digest)
            if ref.format == "safetensors":
                return await loop.run_in_executor(self.pool, _decode_safetensors, data, ref.key)
            info = await loop.run_in_executor(self.pool, lambda: read_info(data, verify=False))
            whole = memoryview(data).cast("B")

            def block_bytes(r: BlockRef) -> memoryview:
                return whole[r.offset:r.offset + r.length]

            verify_blocks = False  # the whole-blob hash above covers every block
        if info.original_size > ref.raw_bytes:  # before a byte of it is decoded
            raise InvalidFormat(f"{ref.key}: its header declares {info.original_size} raw "
                                f"bytes, the manifest records {ref.raw_bytes}")
        refs = info.metadata.get(REFS_KEY, {})
        if not isinstance(refs, dict):
            raise InvalidFormat(f"{ref.key}: malformed tensor references")
        trefs = {name: TensorRef.from_json(raw, ref.key) for name, raw in refs.items()}
        return _Opened(info, block_bytes, verify_blocks, trefs)

    async def _decode(self, ref: BlobRef, opened: _Opened, load_blob: LoadBlob | None,
                      only: frozenset[str] | None) -> dict[str, torch.Tensor]:
        """The tensors (``only`` these) of an opened blob, delta bases and referenced
        tensors fetched through ``load_blob`` and checked."""
        info = opened.info
        loop = asyncio.get_running_loop()
        trefs = {name: r for name, r in opened.refs.items() if only is None or name in only}
        # what is needed from each other blob (delta bases and referenced tensors), so each
        # is asked once, for all of it
        need: dict[str, tuple[BaseRef, set[str]]] = {}
        deltas = {t.name for t in info.tensors if t.base_xxh64 is not None
                  and (only is None or t.name in only)}
        if deltas:
            if ref.base is None or load_blob is None:
                raise MissingPrevious(f"{ref.key} is a delta but names no base it can be "
                                      "decoded against")
            need[ref.base.key] = (ref.base, set(deltas))
        for name, tref in trefs.items():
            if load_blob is None:
                raise MissingPrevious(f"{ref.key}: tensor {name!r} lives in {tref.holder.key}")
            holder_ref, names = need.setdefault(tref.holder.key, (tref.holder, set()))
            if holder_ref.xxh64 != tref.holder.xxh64:
                raise MissingPrevious(f"{ref.key}: tensor {name!r} names {tref.holder.key} with "
                                      f"xxh64 {tref.holder.xxh64}, another link says "
                                      f"{holder_ref.xxh64}")
            names.add(tref.name)
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for key, (base_ref, names) in need.items():
            assert load_blob is not None
            loaded[key] = await load_blob(base_ref, frozenset(names))
        previous = loaded[ref.base.key] if deltas and ref.base is not None else None
        threads = getattr(self.pool, "_max_workers", None)
        try:
            tensors = await loop.run_in_executor(None, lambda: decode_tensors(
                info, opened.block_bytes, previous=previous, threads=threads, only=only,
                verify_payload=opened.verify_blocks))
        except ChecksumMismatch as err:  # name the blob: a block's own message cannot
            raise ChecksumMismatch(f"{ref.key}: {err.where}", err.expected,
                                   err.actual) from None
        except InvalidFormat as err:
            raise type(err)(f"{ref.key}: {err}") from None
        for name, tref in trefs.items():
            holder = loaded[tref.holder.key]
            if tref.name not in holder:
                raise MissingPrevious(f"{ref.key}: tensor {name!r} is not in {tref.holder.key}")
            t = holder[tref.name]
            got = xxhash.xxh64_intdigest(tensor_bytes(t, where=name)[0].data)
            if got != tref.xxh64:
                raise ChecksumMismatch(f"{ref.key}: referenced tensor {name!r} in "
                                       f"{tref.holder.key}", tref.xxh64, got)
            tensors[name] = t
        return tensors


@dataclass(frozen=True)
class _Opened:
    """An MCKP blob fetched and checked, ready to decode (see :meth:`BlobCodec._open`)."""

    info: MckpInfo
    block_bytes: Callable[[BlockRef], memoryview]
    #: whether each block's payload hash is still to be checked (no whole-blob hash was)
    verify_blocks: bool
    #: tensors the blob only references, by name
    refs: dict[str, TensorRef]


def batch_jobs(jobs: list[tuple[int, int, int, int]], chunk_bytes: int
               ) -> list[list[tuple[int, int, int, int]]]:
    """Chunks ``(tensor, chunk, offset, length)`` in batches, in order: runs of small chunks
    (<= ``BATCH_CHUNK_BYTES``) together up to 16 of that size, but never more bytes than one
    chunk (``chunk_bytes``), so a batch fits the budget a chunk does; every other chunk alone.

    Why: a state of many small tensors (norms, biases, step counters) pays a pool task, a
    native call and their Python per chunk; batched it pays them once per batch, and the blob
    is the same (``encode_chunks`` writes ``encode_chunk``'s bytes, in the same order)."""
    cap = min(16 * BATCH_CHUNK_BYTES, chunk_bytes)
    out: list[list[tuple[int, int, int, int]]] = []
    room = 0
    for job in jobs:
        n = job[3]
        if n > BATCH_CHUNK_BYTES or n > room:
            out.append([])
            room = cap
        out[-1].append(job)
        room = room - n if n <= BATCH_CHUNK_BYTES else 0
    return out


def _later(view: U8 | StreamedTensor) -> bool:
    return isinstance(view, StreamedTensor) and view.later


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_raw_bytes(ref: BlobRef, total: int) -> None:
    """A whole blob decodes to exactly the raw bytes its manifest records."""
    if total != ref.raw_bytes:
        raise InvalidFormat(f"{ref.key}: decodes to {total} bytes, manifest records "
                            f"{ref.raw_bytes}")


def skeleton_of(metadata: dict[str, Any], where: str) -> Any:
    """The state skeleton a blob's metadata records (``InvalidFormat`` if absent or not JSON)."""
    raw = metadata.get(SKELETON_KEY)
    if not isinstance(raw, str):
        raise InvalidFormat(f"{where}: blob has no state skeleton")
    try:
        return json.loads(raw)
    except ValueError as err:
        raise InvalidFormat(f"{where}: state skeleton is not JSON ({err})") from None


def _decode_safetensors(data: bytes, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    try:
        tensors = safetensors.torch.load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    except Exception as err:
        raise InvalidFormat(f"{where}: not a valid safetensors blob ({err})") from None
    return skeleton_of(metadata, where), tensors
