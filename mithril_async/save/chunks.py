"""One blob's chunks, encoded on the codec threads while finished ones are written.

The tensors of a compressed blob are cut into chunks; :class:`ChunkRun` submits them to the
codec pool (native transforms and entropy coding, GIL released) and hands finished chunks to
the blob's sink in completion order, so transform, entropy coding and I/O overlap. What is in
flight is bounded by the blob's :class:`~mithril_async.memory.budget.ChunkWindow`; a streamed
tensor's chunk also holds a ring slot from its copy-out until it is encoded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from mithril_async.codec.chunk import (
    BATCH_CHUNK_BYTES,
    CodecParams,
    EncodedChunk,
    encode_chunk,
    encode_chunks,
)
from mithril_async.codec.container import TensorEntry
from mithril_async.memory.budget import ChunkWindow
from mithril_async.save.items import U8, StreamedTensor

if TYPE_CHECKING:
    from mithril_async.memory.ring import SlotLease

__all__ = ["ChunkJob", "ChunkRun", "Sink", "batch_jobs"]

#: one chunk: (tensor index, chunk index, byte offset, length)
ChunkJob = tuple[int, int, int, int]
#: where finished chunks go, in completion order: (tensor index, chunk index, encoded)
Sink = Callable[[int, int, EncodedChunk], Awaitable[None]]
#: a finished pool task: its raw bytes and its encoded chunks
_Done = tuple[int, list[tuple[int, int, EncodedChunk]]]


def batch_jobs(jobs: list[ChunkJob], chunk_bytes: int) -> list[list[ChunkJob]]:
    """Chunks in batches, in order: runs of small chunks (<= ``BATCH_CHUNK_BYTES``) together
    up to 16 of that size, but never more bytes than one chunk (``chunk_bytes``), so a batch
    fits the budget a chunk does; every other chunk alone.

    Why: a state of many small tensors (norms, biases, step counters) pays a pool task, a
    native call and their Python per chunk; batched it pays them once per batch, and the blob
    is the same (``encode_chunks`` writes ``encode_chunk``'s bytes, in the same order)."""
    cap = min(16 * BATCH_CHUNK_BYTES, chunk_bytes)
    out: list[list[ChunkJob]] = []
    room = 0
    for job in jobs:
        n = job[3]
        if n > BATCH_CHUNK_BYTES or n > room:
            out.append([])
            room = cap
        out[-1].append(job)
        room = room - n if n <= BATCH_CHUNK_BYTES else 0
    return out


class ChunkRun:
    """Encode one blob's chunk batches on ``pool`` (a streamed tensor's on ``lanes``).

    A batch of several chunks (small ones, see :func:`batch_jobs`) is one pool task and one
    native call (``encode_chunks``, the same bytes as ``encode_chunk`` of each), and counts
    as one chunk of its total length. Before a batch is submitted it takes its budget from
    ``window``; when none is free, this blob writes its own finished chunks first, and waits
    for budget only when it has nothing in flight, so it never waits while holding budget
    that others wait for."""

    def __init__(self, views: list[U8 | StreamedTensor], bases: list[U8 | None],
                 entries: list[TensorEntry], params: CodecParams, sink: Sink,
                 window: ChunkWindow, pool: Executor, lanes: Executor | None) -> None:
        self.views, self.bases, self.entries, self.params = views, bases, entries, params
        self.sink, self.window, self.pool, self.lanes = sink, window, pool, lanes
        self.pending: dict[asyncio.Future[_Done],
                           tuple[concurrent.futures.Future[Any], SlotLease | None, bool]] = {}
        # finished encodes arrive here in completion order (asyncio.wait over the whole
        # pending set per drained chunk would cost O(chunks^2) callback bookkeeping)
        self.finished: asyncio.Queue[asyncio.Future[_Done]] = asyncio.Queue()

    async def run(self, jobs: list[list[ChunkJob]]) -> None:
        try:
            for batch in jobs:
                await self._submit(batch)
            while self.pending:
                await self._drain_one()
        finally:
            for fut, (cf, lease, _) in self.pending.items():
                if cf.cancel() and lease is not None:  # never started: its slot is free
                    lease.release()
                fut.cancel()
            self.window.close()

    async def _submit(self, batch: list[ChunkJob]) -> None:
        ti = batch[0][0]
        n = sum(j[3] for j in batch)
        while not self.window.fits(n):
            await self._drain_one()
        from_floor = await self._take(n, ti)
        view = self.views[ti]
        lease = (await view.snap.ring.acquire(view.later)
                 if isinstance(view, StreamedTensor) else None)
        pool = (self.lanes or self.pool) if lease is not None else self.pool
        cf = pool.submit(self._encode_batch, batch, lease)
        fut = asyncio.wrap_future(cf, loop=asyncio.get_running_loop())
        fut.add_done_callback(self.finished.put_nowait)
        self.pending[fut] = (cf, lease, from_floor)

    async def _take(self, n: int, ti: int) -> bool:
        """Two chunks of budget for ``n`` raw bytes: the floor, free budget, or our own
        drain; whether it came from the floor."""
        while True:
            got = self.window.take_now(n)
            if got is not None:
                return got
            if not await self._drain_one():  # nothing of ours in flight, no floor
                return await self.window.take_waiting(
                    n, f"a chunk of {self.entries[ti].name!r}")

    async def _drain_one(self) -> bool:
        """Write the next finished batch; False if none is in flight."""
        if not self.pending:
            return False
        fut = await self.finished.get()
        _, _, from_floor = self.pending.pop(fut)
        n, blocks = fut.result()
        for ti, ci, enc in blocks:
            await self.sink(ti, ci, enc)
        self.window.give_back(n, from_floor)
        return True

    def _encode_batch(self, batch: list[ChunkJob], lease: SlotLease | None) -> _Done:
        if len(batch) == 1:
            ti, ci, off, n = batch[0]
            return n, [(ti, ci, self._encode(ti, off, n, lease))]
        items = []
        for ti, _, off, n in batch:
            view, base = self.views[ti], self.bases[ti]
            assert not isinstance(view, StreamedTensor)  # streamed chunks go one by one
            items.append((view[off:off + n], self.entries[ti].dtype,
                          None if base is None else base[off:off + n]))
        encs = encode_chunks(items, self.params)
        return (sum(j[3] for j in batch),
                [(ti, ci, enc) for (ti, ci, _, _), enc in zip(batch, encs, strict=True)])

    def _encode(self, ti: int, off: int, n: int, lease: SlotLease | None) -> EncodedChunk:
        view = self.views[ti]
        try:
            if isinstance(view, StreamedTensor):
                assert lease is not None
                src = view.fetch(lease, off, n)
            else:
                src = view[off:off + n]
            base = self.bases[ti]
            enc = encode_chunk(src, self.entries[ti].dtype,
                               None if base is None else base[off:off + n], self.params)
            if lease is not None:  # a plane stored raw may be a view of the slot
                enc = EncodedChunk(enc.meta, tuple(
                    p.tobytes() if isinstance(p, np.ndarray) else p for p in enc.parts),
                    nonfinite=enc.nonfinite)
            return enc
        finally:
            if lease is not None:  # encoded: the slot may take the next chunk
                lease.release()
