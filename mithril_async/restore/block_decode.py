"""Streaming opened blobs into the live state, window by window, every block verified before
a byte of it is written.

:func:`decode_blocks` is the one loop: the blocks a restore needs are grouped into reads of
a few MiB (:func:`~mithril_async.restore.windows.window_plan`), as many in flight as the
budget allows; each block's header and payload hash is checked before it is decoded into
its destination, its decoded bytes' hash after. From a store with a range reader (local
files) one pool task reads a window and decodes its blocks; otherwise the window is read
with ``get_range`` and its blocks decoded on the pool. No decode is still running when it
returns or raises (:func:`~mithril_async.restore.windows.settled`).

On top of it: :func:`decode_mckp_into` (a whole MCKP blob into same-layout live tensors, or
fresh ones where a tensor cannot take it), :func:`copy_safetensors_into` (an uncompressed
blob, verified whole before, read again and hashed again as it is copied) and
:func:`write_pieces` (the chunks of one saved piece a rank needs, into its live shards by
copy runs). Each calls ``started()`` right before its first write, so the caller knows the
live state is touched.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from mithril_async.codec.chunk import decode_chunk
from mithril_async.codec.container import BlockRef, MckpInfo
from mithril_async.codec.container_read import block_from_bytes
from mithril_async.codec.dtypes import tensor_from_bytes
from mithril_async.codec.kernels import copy_batch
from mithril_async.errors import ChecksumMismatch, InvalidFormat
from mithril_async.manifest import BlobRef
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.restore.sources import SafetensorsInfo
from mithril_async.restore.targets import (
    CopyRuns,
    StagingRing,
    inplace_view,
    mark_written,
    stageable,
)
from mithril_async.restore.windows import (
    checked_read,
    group_windows,
    ordered_reads,
    pool_threads,
    range_reads,
    read_concurrency,
    settled,
    window_plan,
)
from mithril_async.storage.base import Store
from mithril_async.storage.capabilities import RangeReader, RangeReading

__all__ = ["copy_data_rehashed", "copy_safetensors_into", "decode_blocks",
           "decode_mckp_into", "write_pieces"]

Started = Callable[[], None]


async def decode_blocks(store: Store, key: str, info: MckpInfo, blocks: list[BlockRef],
                        dest: Callable[[BlockRef], np.ndarray], pool: Executor, budget: int,
                        started: Started = lambda: None, ring: StagingRing | None = None,
                        after: Callable[[BlockRef, np.ndarray], None] | None = None) -> None:
    """Read ``blocks`` of blob ``key`` and decode each into ``dest(block)`` on ``pool`` (see
    the module docstring). ``started()`` runs (on a pool thread) once the first block has
    passed its checks, before its first byte is decoded. ``ring``: the blocks it wants are
    decoded into a leased buffer of it and copied from there into their live tensor.
    ``after(block, decoded)``: runs on the same pool thread right after a block is decoded
    and verified (``dest`` may hand out a per-thread scratch buffer that ``after`` copies
    from)."""
    window, depth = window_plan(budget, pool_threads(pool), read_concurrency(store))
    windows = group_windows(sorted(blocks, key=lambda r: r.offset), window)
    slots = asyncio.Semaphore(depth)  # windows read and not yet decoded: the memory bound
    dec = _BlockDecoder(key, info, dest, started, ring, after)

    def read_and_decode(reader: RangeReader, span: tuple[int, int],
                        wblocks: list[BlockRef]) -> None:
        mv = checked_read(key, span, reader.read(*span))
        for b in wblocks:
            dec.work(b, mv, span[0])

    async def on_pool(reader: RangeReader, span: tuple[int, int],
                      wblocks: list[BlockRef]) -> None:
        async with slots:
            await settled(pool, [(read_and_decode, (reader, span, wblocks))])

    # a store that reads ranges on the pool's threads (local files): one pool task per
    # window reads it and decodes its blocks (no thread hop between the read and the decode)
    reader = (await store.open_range_reader(key)
              if ring is None and isinstance(store, RangeReading) else None)
    if reader is not None:
        try:
            await all_or_first_error([on_pool(reader, span, wb) for span, wb in windows])
        finally:  # every task has settled: none still reads through it
            reader.close()
        return

    async def one(span: tuple[int, int], wblocks: list[BlockRef]) -> None:
        async with slots:
            mv = checked_read(key, span, await store.get_range(key, *span))
            if ring is None:
                await settled(pool, [(dec.work, (b, mv, span[0])) for b in wblocks])
                return
            await all_or_first_error(
                [settled(pool, [(dec.work, (b, mv, span[0])) for b in wblocks
                                if not ring.wants(b)]),
                 *(dec.staged_block(pool, b, mv, span[0]) for b in wblocks
                   if ring.wants(b))])

    await all_or_first_error([one(span, wblocks) for span, wblocks in windows])


class _BlockDecoder:
    """Checks and decodes one blob's blocks into their destinations (on pool threads)."""

    def __init__(self, key: str, info: MckpInfo, dest: Callable[[BlockRef], np.ndarray],
                 started: Started, ring: StagingRing | None,
                 after: Callable[[BlockRef, np.ndarray], None] | None) -> None:
        self.key, self.info, self.dest = key, info, dest
        self.started, self.ring, self.after = started, ring, after
        self._once = threading.Lock()
        self._fired = False
        #: staged blocks being decoded -> their leased buffer (set and read on one thread)
        self._staged_dest: dict[tuple[int, int], np.ndarray] = {}

    def work(self, b: BlockRef, mv: memoryview, base: int) -> None:
        key, info = self.key, self.info
        try:
            meta, payload = block_from_bytes(mv[b.offset - base:b.offset - base + b.length],
                                             b, info, verify_payload=True)
        except ChecksumMismatch as err:  # name the blob: the block's own message cannot
            raise ChecksumMismatch(f"{key}: {err.where}", err.expected, err.actual) from None
        except InvalidFormat as err:
            raise type(err)(f"{key}: {err}") from None
        if not self._fired:  # the first block verified: the first write is about to happen
            with self._once:
                if not self._fired:
                    self.started()
                    self._fired = True
        out = self._staged_dest.get((b.tensor, b.chunk))
        into = self.dest(b) if out is None else out
        decode_chunk(payload, meta, None, into,
                     where=f"{key}: {info.block_name(b.tensor, b.chunk)}",
                     verify_payload=False)
        if self.after is not None:
            self.after(b, into)

    def _work_staged(self, b: BlockRef, mv: memoryview, base: int, lease: Any) -> None:
        assert self.ring is not None
        ln = self.info.tensors[b.tensor].chunks[b.chunk][1]
        self._staged_dest[(b.tensor, b.chunk)] = lease.array[:ln]
        try:
            self.work(b, mv, base)
        finally:
            del self._staged_dest[(b.tensor, b.chunk)]
        self.ring.finish(b, lease)

    async def staged_block(self, pool: Executor, b: BlockRef, mv: memoryview, base: int
                           ) -> None:
        """Decode ``b`` into a leased buffer of the ring, copied from there into its live
        tensor."""
        assert self.ring is not None
        lease = await self.ring.lease()
        try:  # settled: the work has finished (or never started) when this returns
            await settled(pool, [(self._work_staged, (b, mv, base, lease))])
        finally:
            self.ring.release(lease)


class _Tracked:
    """``started`` wrapped so the caller knows afterwards whether anything was written."""

    def __init__(self, started: Started) -> None:
        self.inner, self.fired = started, False

    def __call__(self) -> None:
        self.fired = True
        self.inner()


async def decode_mckp_into(store: Store, ref: BlobRef, info: MckpInfo,
                           live: Mapping[str, torch.Tensor], pool: Executor, budget: int,
                           started: Started) -> dict[str, torch.Tensor]:
    """Decode opened MCKP blob ``ref`` straight into the live tensors ``live`` (by stored
    name); return its tensors, where one written in place *is* the live one. A live tensor
    that cannot take the bytes in place but is :func:`~.targets.stageable` gets them through
    a :class:`~.targets.StagingRing`; any other saved tensor is decoded into a fresh one."""
    outs: list[np.ndarray] = []
    tensors: dict[str, torch.Tensor] = {}
    fresh: list[int] = []
    staged: dict[int, torch.Tensor] = {}
    for ti, t in enumerate(info.tensors):
        target = live.get(t.name)
        view = None if target is None else inplace_view(target, t.dtype, t.shape)
        if view is None and target is not None and stageable(target, t.dtype, t.shape):
            staged[ti] = target
            tensors[t.name] = target
            view = np.empty(0, np.uint8)  # decoded through the staging ring instead
        elif view is None:
            view = np.empty(t.nbytes, np.uint8)
            fresh.append(ti)
        else:
            tensors[t.name] = target  # type: ignore[assignment]
        outs.append(view)
    ring = None
    if staged:
        biggest = max(ln for ti in staged for _, ln in info.tensors[ti].chunks)
        # as many buffers as windows in flight, within the budget (at least one)
        depth = window_plan(budget, pool_threads(pool), read_concurrency(store))[1]
        ring = StagingRing(info, staged, biggest, max(1, min(depth, budget // biggest)))

    def dest(b: BlockRef) -> np.ndarray:
        off, ln = info.tensors[b.tensor].chunks[b.chunk]
        return outs[b.tensor][off:off + ln]

    tracked = _Tracked(started)
    blocks = sorted(info.index.values(), key=lambda r: r.offset)
    try:
        await decode_blocks(store, ref.key, info, blocks, dest, pool, budget, tracked, ring)
    finally:  # what was written is written, whatever stopped the rest
        if tracked.fired:
            mark_written(t for n, t in tensors.items() if live.get(n) is t)
    for ti in fresh:
        t = info.tensors[ti]
        tensors[t.name] = tensor_from_bytes(outs[ti], t.dtype, t.shape, where=t.name)
    return tensors


async def copy_safetensors_into(store: Store, ref: BlobRef, st: SafetensorsInfo,
                                live: Mapping[str, torch.Tensor], pool: Executor, budget: int,
                                started: Started) -> dict[str, torch.Tensor]:
    """Copy an opened uncompressed blob, verified whole before, straight into the live
    tensors window by window (one native ``copy_batch`` per window, GIL released), hashing
    every byte again as it copies (:func:`copy_data_rehashed`); a tensor the live state
    cannot take in place is copied into a fresh one."""
    start = st.data_start
    outs: list[tuple[int, int, int]] = []  # (begin, end, destination address)
    tensors: dict[str, torch.Tensor] = {}
    for e in st.entries:
        target = live.get(e.name)
        view = None if target is None else inplace_view(target, e.dtype, e.shape)
        if view is None:
            view = np.empty(e.end - e.begin, np.uint8)
            tensors[e.name] = tensor_from_bytes(view, e.dtype, e.shape, where=e.name)
        else:
            tensors[e.name] = target  # type: ignore[assignment]
        # the live tensors and ``tensors`` keep every destination alive while it is copied to
        outs.append((e.begin, e.end, view.ctypes.data if view.size else 0))
    tracked = _Tracked(started)

    def copy(off: int, data: bytes) -> None:  # one window at a time, on a pool thread
        base = np.frombuffer(data, np.uint8).ctypes.data
        w0, w1 = off - start, off - start + len(data)
        jobs = [(base + max(b, w0) - w0, dst + max(b, w0) - b, min(e, w1) - max(b, w0))
                for b, e, dst in outs if b < w1 and e > w0 and dst]
        tracked()
        copy_batch(jobs)

    try:
        await copy_data_rehashed(store, ref, pool, budget, st, copy)
    finally:
        if tracked.fired:
            mark_written(t for n, t in tensors.items() if live.get(n) is t)
    return tensors


async def copy_data_rehashed(store: Store, ref: BlobRef, pool: Executor, budget: int,
                             st: SafetensorsInfo, copy: Callable[[int, bytes], None]) -> None:
    """The second pass over a safetensors blob verified whole before: its data area read
    again in order, window by window, ``copy(offset, window)`` run on ``pool`` beside the
    window's hash (every byte hashed again, with the head), so a blob that changed since the
    verifying pass is :class:`ChecksumMismatch` ("changed while it was restored")."""
    h = st.hasher()
    size = ref.bytes
    window, depth = window_plan(budget, pool_threads(pool))

    async def process(off: int, data: bytes) -> None:
        await settled(pool, [(copy, (off, data)), (h.update, (data,))])

    async with range_reads(store, ref.key, pool) as read:
        await ordered_reads([(o, min(window, size - o))
                             for o in range(st.data_start, size, window)],
                            read, depth, process, ref.key)
    got = h.hexdigest()
    if got != ref.xxh64:
        raise ChecksumMismatch(f"{ref.key} (changed while it was restored)", ref.xxh64, got)


async def write_pieces(store: Store, ref: BlobRef, runs: Mapping[str, CopyRuns],
                       info: MckpInfo | None, st: SafetensorsInfo | None,
                       tensors: Mapping[str, torch.Tensor] | None, pool: Executor,
                       budget: int, started: Started) -> None:
    """Write what one saved piece blob holds of the tensors ``runs`` names into the live
    shards: from an opened MCKP blob only the chunks covering the runs (a chunk inside one
    run decoded straight into the shard, others into a per-thread buffer whose runs are
    copied out right after); from an uncompressed one, read again in order and hashed
    again; from tensors decoded whole before (a delta piece), copied."""
    if info is not None:
        await _pieces_from_mckp(store, ref.key, info, runs, pool, budget, started)
    elif st is not None:
        await _pieces_from_safetensors(store, ref, st, runs, pool, budget, started)
    else:
        assert tensors is not None
        decoded = tensors

        def copy_all() -> None:
            started()
            for name, r in runs.items():
                t = decoded[name]
                r.copy_from(0, t.reshape(-1).view(torch.uint8).numpy() if t.numel()
                            else np.empty(0, np.uint8))

        await settled(pool, [(copy_all, ())])


async def _pieces_from_mckp(store: Store, key: str, info: MckpInfo,
                            runs: Mapping[str, CopyRuns], pool: Executor, budget: int,
                            started: Started) -> None:
    index = {t.name: ti for ti, t in enumerate(info.tensors)}
    by_tensor: dict[int, CopyRuns] = {}
    blocks: list[BlockRef] = []
    for name, r in runs.items():
        ti = index[name]
        by_tensor[ti] = r
        lo, hi = r.span
        for ci, (off, ln) in enumerate(info.tensors[ti].chunks):
            if off < hi and off + ln > lo:
                blocks.append(info.index[(ti, ci)])
    scratch = threading.local()  # per codec thread: a chunk buffer, and where dest() went

    def dest(b: BlockRef) -> np.ndarray:
        off, ln = info.tensors[b.tensor].chunks[b.chunk]
        direct = by_tensor[b.tensor].inside_one(off, ln)
        scratch.direct = direct is not None
        if direct is not None:
            return direct
        buf = getattr(scratch, "buf", None)
        if buf is None or buf.size < ln:
            buf = scratch.buf = np.empty(ln, np.uint8)
        out: np.ndarray = buf[:ln]
        return out

    def after(b: BlockRef, decoded: np.ndarray) -> None:  # same thread, right after dest()
        if not scratch.direct:
            by_tensor[b.tensor].copy_from(info.tensors[b.tensor].chunks[b.chunk][0], decoded)

    await decode_blocks(store, key, info, blocks, dest, pool, budget, started, after=after)


async def _pieces_from_safetensors(store: Store, ref: BlobRef, st: SafetensorsInfo,
                                   runs: Mapping[str, CopyRuns], pool: Executor, budget: int,
                                   started: Started) -> None:
    ranges = [(st.data_start + e.begin, st.data_start + e.end, runs[e.name])
              for e in st.entries if e.name in runs]

    def copy(off: int, data: bytes) -> None:
        buf = np.frombuffer(data, np.uint8)
        end = off + buf.size
        for b, e, r in ranges:
            lo, hi = max(b, off), min(e, end)
            if lo < hi:
                started()
                r.copy_from(lo - b, buf[lo - off:hi - off])

    await copy_data_rehashed(store, ref, pool, budget, st, copy)
