"""Restores that write straight into the live tensors, with memory bounded by the pipeline's
in-flight budget, whatever the state's size.

Same layout (:func:`decode_into`), two ways of verifying (``[checkpointing.restore] verify``):

- ``"block"`` (default): each MCKP blob is read once, by ranges, in windows of a few MiB: its
  size (the manifest's), trailer, header and index checked by their own hashes, the blocks
  tiling the data area (no gap, no overlap, so every byte but the 8-byte whole-blob hash at
  the end is under a hash this pass checks), the header's step and item the manifest's; then
  every block's header and payload hash before a byte of it is decoded straight into the live
  tensors' memory, its decoded bytes' hash after. Truncation, extension and reordered or
  swapped blocks are caught (size, trailer, index, each block's own tensor/chunk numbers).
  The manifest's whole-blob xxh64 is not recomputed: it would cost a serial hash of every
  byte (~15 % of a restore here); what it alone would catch is a self-consistent blob of the
  same size, step and item that is not the recorded one (another rank's shard, say).
- ``"whole"``: every blob is first verified whole (:func:`verify_blob`: streamed, size and
  the manifest's xxh64), with nothing written, then read again and decoded as above.

Uncompressed (``.safetensors``) blobs carry one whole-file hash and no per-block ones: in both
modes they are verified whole first, then copied in by one native ``copy_batch`` per window
(GIL released, no ``torch.Tensor.copy_``) while their bytes are hashed again. A live tensor of
another shape is :class:`~mithril_async.errors.ShapeMismatch` before any item writes. One of
another dtype or on a device (CUDA), contiguous, is staged (:class:`StagingRing`): each block
is decoded into one of a few reused chunk-sized host buffers (pinned when a target is on a
device) and copied from there into its span of the live tensor (converting the dtype; on
CUDA a ``non_blocking`` copy on a side stream, the buffer reused only once its event has
completed), so it too is restored in place within a bounded memory. A live tensor that is
not contiguous is decoded into a fresh tensor as before (``load_state_dict`` then copies it).

Sharded state on any world size and mesh is restored from its pieces by
:mod:`~mithril_async.pipeline.pieces`, with the pieces of this module (blob opening, block
streaming, verification, ``settled``).

Guarantee: a missing blob or RNG file, a damaged RNG file, trailer, header or index, a live
shape that differs, and with ``"whole"`` any damage, leave the live state untouched and
raise their own typed error (so ``restore(fallback=True)`` can move on to an older version).
With ``"block"`` a damaged block is found only when its window is read: if no block of the
restore has been written yet, its own typed error (untouched); otherwise
:class:`~mithril_async.errors.RestoreIncomplete` naming the blobs written (partially
overwritten: the blocks decoded so far hold the version's bytes, the others their old ones),
and the reader's ``fallback=True`` then writes an older version over every item touched. The
same :class:`~mithril_async.errors.RestoreIncomplete` for a blob that changed between the
two reads (``"whole"``).
Never returned as if restored; no decode is still running when the error is raised
(:func:`settled`). Tensors written here have their autograd version counter bumped, as
``copy_`` would.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from mithril_async.codec.chunk import decode_chunk
from mithril_async.codec.container import (
    FLAG_DELTA,
    PREAMBLE,
    AsyncMckpRangeReader,
    BlockRef,
    MckpInfo,
    block_from_bytes,
)
from mithril_async.codec.dtypes import dtype_info, tensor_from_bytes
from mithril_async.codec.kernels import copy_batch
from mithril_async.codec.safetensors_io import SAFETENSORS_DTYPES
from mithril_async.errors import (
    ChecksumMismatch,
    InvalidFormat,
    RestoreIncomplete,
    ShapeMismatch,
)
from mithril_async.manifest import BlobRef
from mithril_async.pipeline.blobs import (
    ITEM_KEY,
    REFS_KEY,
    skeleton_of,
)
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.storage.base import RangeReader, Store, open_range_reader

__all__ = ["CudaCopier", "HostCopier", "Progress", "SafetensorsInfo", "StagingRing",
           "check_binding", "check_tiling", "checked_read", "copier_for",
           "copy_data_rehashed", "decode_blocks", "decode_into", "guard_writes",
           "inplace_view", "mark_written", "open_mckp", "open_safetensors", "ordered_reads",
           "pool_threads", "range_reads", "settled", "stageable", "takes_in_place",
           "verify_blob", "window_plan"]


@dataclass
class Progress:
    """What a restore has written into the live state so far (for its failure message)."""

    written: list[str] = field(default_factory=list)
    #: the state items written into (some of their tensors may hold their old values)
    items: set[str] = field(default_factory=set)

    @property
    def touched(self) -> bool:
        return bool(self.written)


def mark_written(tensors: Iterable[torch.Tensor]) -> None:
    """Bump the autograd version counter of tensors written behind torch's back (as
    ``copy_`` would), so a graph that saved one of them for backward refuses to use it."""
    from torch.autograd.graph import increment_version

    for t in tensors:
        if t.numel():
            increment_version(t)


class guard_writes:
    """Turn an error into :class:`RestoreIncomplete` once the live state has been written."""

    def __init__(self, version: str, progress: Progress) -> None:
        self.version, self.progress = version, progress

    def __enter__(self) -> guard_writes:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: Any) -> None:
        if e is None or not self.progress.touched or isinstance(e, RestoreIncomplete):
            return
        if isinstance(e, Exception):
            raise RestoreIncomplete(
                f"restore of {self.version} failed after writing into the live state "
                f"({', '.join(self.progress.written)}): it is partially overwritten; "
                f"cause: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------ same layout: decode in place
def inplace_view(t: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The live tensor's bytes as a writable uint8 view when a chunk may be decoded straight
    into them (CPU, contiguous, same dtype and shape, no lazy conj/neg bit); None otherwise."""
    if (t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous()
            or tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype
            or t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested or t.numel() == 0):
        return None
    try:
        view: np.ndarray = t.detach().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None
    return view if view.flags.writeable else None


async def decode_into(store: Store, ref: BlobRef, live: Mapping[str, torch.Tensor],
                      pool: Any, budget: int, version: str, progress: Progress,
                      opened: Callable[[], Awaitable[None]] | None = None,
                      verified: bool = True, step: int | None = None,
                      item: str | None = None,
                      ) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """Decode MCKP blob ``ref`` straight into the live tensors ``live`` (by stored name),
    streaming its blocks in windows (:func:`window_plan`: a few MiB each, as many in flight
    as keep the codec threads busy within ``budget`` bytes); return ``(skeleton, tensors)``,
    where a tensor written in place *is* the live one. An uncompressed (safetensors) blob is
    copied in the same way (:func:`_decode_safetensors_into`). None when the blob is not one
    this path takes (:func:`takes_in_place`): the caller decodes it the usual way.

    ``verified``: the caller has verified the whole blob first (:func:`verify_blob`; the
    ``"whole"`` mode). Either way this pass checks the trailer, header and index by their own
    hashes, every block's header and payload hash before any byte of it is decoded into a
    live tensor (a blob changed since the verifying pass is caught there), and its decoded
    bytes' hash right after. Not ``verified`` (the one-pass ``"block"`` mode of an MCKP
    blob), before anything is written: the blocks must tile the data area exactly (no gap,
    no overlap), and the header's training step and item name, where it records them, must
    be ``step`` and ``item`` (the manifest's): a blob of another version or item put in
    its place is :class:`InvalidFormat`. A tensor the
    live state cannot take in place (another dtype, not contiguous, not on the CPU) is
    decoded into a fresh tensor as before. A live tensor of another shape than the saved one
    is :class:`ShapeMismatch` naming it, raised once the header is read and before anything
    is written; ``opened()`` is awaited then, before the first write (the reader makes every
    item of a restore pass its checks before any item writes).
    """
    if not takes_in_place(ref):
        return None
    size = await store.size(ref.key)
    if size != ref.bytes:
        raise InvalidFormat(f"{ref.key}: {size} bytes, manifest says {ref.bytes}")
    if ref.format == "safetensors":
        return await _decode_safetensors_into(store, ref, live, pool, budget, progress, opened)

    info = await open_mckp(store, ref, size)
    skeleton = skeleton_of(info.metadata, ref.key)
    _check_shapes(ref.key, live, ((t.name, t.shape) for t in info.tensors))
    blocks = sorted(info.index.values(), key=lambda r: r.offset)
    if not verified:
        check_tiling(ref.key, info, blocks)
        check_binding(ref.key, info, step, item)
    if opened is not None:
        await opened()
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
        depth = window_plan(budget, pool_threads(pool), _remote(store))[1]
        ring = StagingRing(info, staged, biggest, max(1, min(depth, budget // biggest)))

    def dest(b: BlockRef) -> np.ndarray:
        off, ln = info.tensors[b.tensor].chunks[b.chunk]
        return outs[b.tensor][off:off + ln]

    def started() -> None:
        if ref.key not in progress.written:
            progress.written.append(ref.key)

    try:
        await decode_blocks(store, ref.key, info, blocks, dest, pool, budget, started, ring)
    finally:  # what was written is written, whatever stopped the rest
        if ref.key in progress.written:
            mark_written(t for n, t in tensors.items() if live.get(n) is t)
    for ti in fresh:
        t = info.tensors[ti]
        tensors[t.name] = tensor_from_bytes(outs[ti], t.dtype, t.shape, where=t.name)
    return skeleton, tensors


async def open_mckp(store: Store, ref: BlobRef, size: int) -> MckpInfo:
    """Trailer, header and index of MCKP blob ``ref`` by ranged reads, each checked by its
    own hash; a blob that is a delta or references tensors its manifest entry does not name,
    or declares other raw bytes than recorded, is :class:`InvalidFormat`. Every byte is read
    once (the preamble is not fetched again with the header)."""
    got: dict[tuple[int, int], bytes] = {}  # (offset, length) -> bytes

    async def read_range(offset: int, length: int) -> bytes:
        pre = got.get((0, PREAMBLE.size))
        if offset == 0 and pre is not None and length > len(pre):  # the header: the rest
            data = pre + await store.get_range(ref.key, len(pre), length - len(pre))
        else:
            data = await store.get_range(ref.key, offset, length)
        got[(offset, length)] = data
        return data

    try:
        info = await AsyncMckpRangeReader(read_range, size).open()
    except ChecksumMismatch as err:  # name the blob: the piece's own message cannot
        raise ChecksumMismatch(f"{ref.key}: {err.where}", err.expected, err.actual) from None
    except InvalidFormat as err:
        raise type(err)(f"{ref.key}: {err}") from None
    if info.flags & FLAG_DELTA or info.metadata.get(REFS_KEY):
        raise InvalidFormat(f"{ref.key}: holds deltas or tensor references its manifest "
                            "entry does not name")
    if info.original_size != ref.raw_bytes:
        raise InvalidFormat(f"{ref.key}: its header declares {info.original_size} raw bytes, "
                            f"the manifest records {ref.raw_bytes}")
    return info


def check_tiling(key: str, info: MckpInfo, blocks: list[BlockRef]) -> None:
    """The blocks (sorted by offset) fill the data area exactly, as the writer lays them out:
    what a one-pass restore hashes window by window is then every byte of the blob."""
    at = info.data_start
    for b in blocks:
        if b.offset != at:
            raise InvalidFormat(f"{key}: {info.block_name(b.tensor, b.chunk)} starts at "
                                f"{b.offset}, the previous block ends at {at}")
        at += b.length
    if at != info.data_end:
        raise InvalidFormat(f"{key}: the blocks end at {at}, the index starts at "
                            f"{info.data_end}")


def stageable(t: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a live tensor that cannot take decoded bytes in place takes them through the
    staging ring: dense, contiguous, of the saved shape, on the CPU or a CUDA device, of a
    dtype torch can convert the saved one to (the saved dtype known to torch)."""
    info = dtype_info(dtype)
    return (info.torch_dtype is not None and t.layout == torch.strided and t.is_contiguous()
            and tuple(t.shape) == tuple(shape) and t.device.type in ("cpu", "cuda")
            and not (t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested)
            and t.numel() > 0)


class HostCopier:
    """Copies a staged chunk into its span of a CPU live tensor (converting its dtype)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class CudaCopier:
    """Copies a staged chunk (pinned) into its span of a CUDA live tensor: a ``non_blocking``
    copy on a side stream ordered after the work queued on the current stream when the
    restore began (``ready``: nothing still using the live tensor is overwritten under it),
    then that copy's event waited for on this (codec) thread only, so the buffer is reused
    only once the device has read it (no device-wide synchronize), and every copy is done
    when the restore returns."""

    def __init__(self, device: torch.device) -> None:
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        event.synchronize()


def copier_for(device: torch.device) -> HostCopier | CudaCopier:
    """The copier for live tensors on ``device`` (tests stand in for the CUDA one)."""
    return CudaCopier(device) if device.type == "cuda" else HostCopier()


class StagingRing:
    """A few reused host buffers of one chunk each through which the blocks of staged
    tensors reach their live tensors (:func:`stageable`): a block's buffer is leased before
    its decode is submitted (at most ``slots`` at a time, so at most ``slots`` chunks of
    memory) and given back once its copy into the live tensor is complete. Pinned when a
    target is on a CUDA device."""

    def __init__(self, info: MckpInfo, targets: Mapping[int, torch.Tensor], slot_bytes: int,
                 slots: int) -> None:
        from mithril_async.memory.ring import SlotRing

        self.info, self.targets = info, targets
        pin = any(t.device.type == "cuda" for t in targets.values()) \
            and torch.cuda.is_available()
        self.ring = SlotRing(max(1, slots), slot_bytes, pin=pin)
        self.copiers = {d: copier_for(d) for d in {t.device for t in targets.values()}}
        #: the most buffers leased at once (for tests: the bound)
        self.peak = 0
        self._held = 0
        self._lock = threading.Lock()

    def wants(self, b: BlockRef) -> bool:
        return b.tensor in self.targets

    async def lease(self) -> Any:
        lease = await self.ring.acquire()
        with self._lock:
            self._held += 1
            self.peak = max(self.peak, self._held)
        return lease

    def release(self, lease: Any) -> None:
        with self._lock:
            self._held -= 1
        lease.release()

    def finish(self, b: BlockRef, lease: Any) -> None:
        """Copy block ``b``'s decoded bytes (in leased buffer ``lease``) into its span of
        the live tensor."""
        t = self.info.tensors[b.tensor]
        off, ln = t.chunks[b.chunk]
        info = dtype_info(t.dtype)
        target = self.targets[b.tensor].detach()  # a leaf that requires grad takes it too
        src = lease.tensor[:ln].view(info.torch_dtype)
        dst = target.view(-1)[off // info.itemsize:(off + ln) // info.itemsize]
        self.copiers[target.device].copy(dst, src)


def check_binding(key: str, info: MckpInfo, step: int | None, item: str | None) -> None:
    """The blob's header records the version's step and the item it belongs to (where it
    records them): a blob of another version or item put in this one's place is caught
    without its whole hash."""
    if step is not None and info.training_step is not None and info.training_step != step:
        raise InvalidFormat(f"{key}: its header says step {info.training_step}, the manifest's is "
                            f"{step} (a blob of another version?)")
    saved = info.metadata.get(ITEM_KEY)
    if item is not None and saved is not None and saved != item:
        raise InvalidFormat(f"{key}: its header says item {saved!r}, the manifest lists it "
                            f"as {item!r}")


async def decode_blocks(store: Store, key: str, info: MckpInfo, blocks: list[BlockRef],
                        dest: Callable[[BlockRef], np.ndarray], pool: Any, budget: int,
                        started: Callable[[], None] = lambda: None,
                        ring: StagingRing | None = None,
                        after: Callable[[BlockRef, np.ndarray], None] | None = None) -> None:
    """Read ``blocks`` of blob ``key`` (adjacent ones merged into reads of a few MiB, as many
    in flight as :func:`window_plan` allows within ``budget``) and decode each into
    ``dest(block)`` on ``pool``: its header and payload hash checked before a byte of it is
    decoded, its decoded bytes' hash after. ``started()`` runs (on a pool thread) once the
    first block has passed its checks, before its first byte is decoded; no decode is still
    running when this returns or raises (:func:`settled`). ``ring``: the blocks it wants are
    decoded into a leased buffer of it and copied from there into their live tensor.
    ``after(block, decoded)``: runs on the same pool thread right after a block is decoded
    and verified (``dest`` may hand out a per-thread scratch buffer that ``after`` copies
    from)."""
    window, depth = window_plan(budget, pool_threads(pool), _remote(store))
    windows = _windows(sorted(blocks, key=lambda r: r.offset), window)
    slots = asyncio.Semaphore(depth)  # windows read and not yet decoded: the memory bound

    once = threading.Lock()
    fired = [False]

    def work(b: BlockRef, mv: memoryview, base: int) -> None:
        try:
            meta, payload = block_from_bytes(mv[b.offset - base:b.offset - base + b.length],
                                             b, info, verify_payload=True)
        except ChecksumMismatch as err:  # name the blob: the block's own message cannot
            raise ChecksumMismatch(f"{key}: {err.where}", err.expected, err.actual) from None
        except InvalidFormat as err:
            raise type(err)(f"{key}: {err}") from None
        if not fired[0]:  # the first block verified: the first write is about to happen
            with once:
                if not fired[0]:
                    started()
                    fired[0] = True
        out = staged_dest.get((b.tensor, b.chunk))
        into = dest(b) if out is None else out
        decode_chunk(payload, meta, None, into,
                     where=f"{key}: {info.block_name(b.tensor, b.chunk)}",
                     verify_payload=False)
        if after is not None:
            after(b, into)

    #: staged blocks being decoded -> their leased buffer (set and read on one pool thread)
    staged_dest: dict[tuple[int, int], np.ndarray] = {}

    def work_staged(b: BlockRef, mv: memoryview, base: int, lease: Any) -> None:
        assert ring is not None
        ln = info.tensors[b.tensor].chunks[b.chunk][1]
        staged_dest[(b.tensor, b.chunk)] = lease.array[:ln]
        try:
            work(b, mv, base)
        finally:
            del staged_dest[(b.tensor, b.chunk)]
        ring.finish(b, lease)

    async def staged_block(b: BlockRef, mv: memoryview, base: int) -> None:
        assert ring is not None
        lease = await ring.lease()
        try:  # settled: the work has finished (or never started) when this returns
            await settled(pool, [(work_staged, (b, mv, base, lease))])
        finally:
            ring.release(lease)

    def read_and_decode(reader: RangeReader, span: tuple[int, int],
                        wblocks: list[BlockRef]) -> None:
        mv = checked_read(key, span, reader.read(*span))
        for b in wblocks:
            work(b, mv, span[0])

    async def on_pool(reader: RangeReader, span: tuple[int, int],
                      wblocks: list[BlockRef]) -> None:
        async with slots:
            await settled(pool, [(read_and_decode, (reader, span, wblocks))])

    # a store that reads ranges on the pool's threads (local files): one pool task per
    # window reads it and decodes its blocks (no thread hop between the read and the decode)
    reader = None if ring is not None else await open_range_reader(store, key)
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
                await settled(pool, [(work, (b, mv, span[0])) for b in wblocks])
                return
            await all_or_first_error(
                [settled(pool, [(work, (b, mv, span[0])) for b in wblocks
                                if not ring.wants(b)]),
                 *(staged_block(b, mv, span[0]) for b in wblocks if ring.wants(b))])

    await all_or_first_error([one(span, wblocks) for span, wblocks in windows])


def checked_read(key: str, span: tuple[int, int], data: bytes) -> memoryview:
    """The bytes of a ranged read of ``span`` (offset, length), as a memoryview, or
    :class:`InvalidFormat` when the read returned another length (the blob shrank)."""
    if len(data) != span[1]:
        raise InvalidFormat(f"{key}: ranged read of {span[1]} bytes at {span[0]} "
                            f"returned {len(data)}")
    return memoryview(data).cast("B")


#: bytes per ranged read of a streamed restore: small enough that a window read is still in
#: the CPU cache when it is hashed or decoded (64 MiB windows read at a fifth of the speed
#: of 4 MiB ones here), big enough that a read's per-call cost vanishes
WINDOW = 4 << 20


#: bytes per ranged read from a remote store (S3): a request's latency is paid per read, and
#: servers serve larger ranges at full speed
REMOTE_WINDOW = 8 << 20


def window_plan(budget: int, threads: int, remote: int = 0) -> tuple[int, int]:
    """``(window bytes, windows in flight)`` for a restore allowed ``budget`` bytes in
    flight: :data:`WINDOW`-sized reads, as many in flight as keep every codec thread busy
    (two per thread, at least 3) and fit the budget (at least 2). ``remote``: the store's
    request concurrency, for a store across a network (``remote_reads``): reads of up to
    :data:`REMOTE_WINDOW` (half the budget at most, :data:`WINDOW` at least), as many in
    flight as the store runs requests at once and the budget allows (at least 2): there
    the reads' latency, not the codec threads, is what to hide."""
    if remote:
        window = max(WINDOW, min(REMOTE_WINDOW, budget // 2))
        return window, max(2, min(remote, budget // window))
    depth = max(2, min(max(3, 2 * threads), budget // WINDOW))
    return WINDOW, depth


def _remote(store: Store) -> int:
    """The request concurrency of a store read across a network (0 for a local one)."""
    if not getattr(store, "remote_reads", False):
        return 0
    return max(1, int(getattr(store, "max_concurrency", 8) or 8))


@contextlib.asynccontextmanager
async def range_reads(store: Store, key: str, pool: Any
                      ) -> AsyncIterator[Callable[[int, int], Awaitable[bytes]]]:
    """``read(offset, length)`` of blob ``key``: on ``pool`` through one open file where the
    store offers it (:func:`~mithril_async.storage.base.open_range_reader`), else the store's
    ``get_range``."""
    reader = await open_range_reader(store, key)
    if reader is None:
        yield lambda off, ln: store.get_range(key, off, ln)
        return
    loop = asyncio.get_running_loop()
    try:
        yield lambda off, ln: loop.run_in_executor(pool, reader.read, off, ln)
    finally:  # a read still running closes the file when it ends
        reader.close()


async def ordered_reads(spans: list[tuple[int, int]], read: Any, depth: int,
                        process: Any, where: str) -> None:
    """Read ``spans`` with up to ``depth`` reads in flight and ``await process(off, data)``
    for each, in order (a streamed hash needs the bytes in order)."""
    pending: collections.deque[tuple[int, int, asyncio.Future[bytes]]] = collections.deque()
    it = iter(spans)

    def more() -> None:
        nxt = next(it, None)
        if nxt is not None:
            pending.append((*nxt, asyncio.ensure_future(read(*nxt))))

    try:
        for _ in range(depth):
            more()
        while pending:
            off, ln, fut = pending.popleft()
            data = await fut
            more()
            if len(data) != ln:
                raise InvalidFormat(f"{where}: ranged read of {ln} bytes at {off} returned "
                                    f"{len(data)}")
            await process(off, data)
    finally:
        for _, _, fut in pending:
            fut.cancel()


async def verify_blob(store: Store, ref: BlobRef, pool: Any, budget: int) -> None:
    """Check blob ``ref``'s size and xxh64 against the manifest, streaming it through
    ``budget`` bytes (reads run ahead while earlier windows are hashed): the pass that lets
    :func:`decode_into` write into the live tensors only once every byte of every blob of the
    version is known good, without holding a blob."""
    size = await store.size(ref.key)
    if size != ref.bytes:
        raise InvalidFormat(f"{ref.key}: {size} bytes, manifest says {ref.bytes}")
    h = xxhash.xxh64()
    loop = asyncio.get_running_loop()
    window, depth = window_plan(budget, pool_threads(pool))

    async def update(_off: int, data: bytes) -> None:
        await loop.run_in_executor(pool, h.update, data)

    async with range_reads(store, ref.key, pool) as read:
        await ordered_reads([(o, min(window, size - o)) for o in range(0, size, window)],
                            read, depth, update, ref.key)
    got = h.hexdigest()
    if got != ref.xxh64:
        raise ChecksumMismatch(ref.key, ref.xxh64, got)


async def settled(pool: Any, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    """Run ``calls`` on ``pool``; return (or raise the first one's error) only once none is
    running, even when cancelled meanwhile (a call not started yet is then dropped): a call
    writing into the live tensors cannot be stopped once it runs, and a restore must not
    report, nor a fallback begin writing an older version, while one still writes."""
    if not calls:
        return
    futs = [pool.submit(fn, *args) for fn, args in calls]
    waits = [asyncio.wrap_future(f) for f in futs]
    try:
        await asyncio.wait(waits)
    except asyncio.CancelledError:
        for f in futs:
            f.cancel()  # those not started yet; a running one goes on
        running = [w for w in waits if not w.done()]
        if running:
            await asyncio.wait(running)
        for w in waits:  # retrieved: the cancellation is what is raised
            if w.done() and not w.cancelled():
                w.exception()
        raise
    errors = [w.exception() for w in waits]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def pool_threads(pool: Any) -> int:
    return int(getattr(pool, "_max_workers", 1) or 1)


def takes_in_place(ref: BlobRef) -> bool:
    """Whether :func:`decode_into` decodes this blob: an MCKP blob that is no delta and
    references no tensor of another version, or an uncompressed (safetensors) blob."""
    return ref.format in ("mckp", "safetensors") and ref.base is None and not ref.refs


#: safetensors dtype codes -> the codec's dtype names
_ST_DTYPES = {code: str(dt).removeprefix("torch.") for dt, code in SAFETENSORS_DTYPES.items()}


def _st_entries(header: Any, data_len: int, where: str
                ) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """``(name, dtype, shape, begin, end)`` of every tensor of a safetensors header, each
    checked (known dtype, size = elements x width, inside the data, no two overlapping)."""
    if not isinstance(header, dict):
        raise InvalidFormat(f"{where}: safetensors header is not a JSON object")
    out = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[e["dtype"]]
            shape = tuple(int(x) for x in e["shape"])
            b, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidFormat(f"{where}: malformed safetensors entry {name!r} ({err})") from None
        width = dtype_info(dtype).itemsize
        if any(x < 0 for x in shape) or not 0 <= b <= end <= data_len \
                or end - b != width * math.prod(shape):
            raise InvalidFormat(f"{where}: safetensors entry {name!r} does not fit its data")
        out.append((name, dtype, shape, b, end))
    out.sort(key=lambda x: x[3])
    for (n1, _, _, _, e1), (n2, _, _, b2, _) in itertools.pairwise(out):
        if b2 < e1:
            raise InvalidFormat(f"{where}: safetensors entries {n1!r} and {n2!r} overlap")
    return out


@dataclass
class SafetensorsInfo:
    """What the head of an uncompressed (safetensors) blob says: its tensors (``entries``:
    name, dtype, shape, begin, end within the data area), where its data area begins, its
    state skeleton, and the bytes before the data (hashed first by :meth:`hasher`)."""

    entries: list[tuple[str, str, tuple[int, ...], int, int]]
    data_start: int
    skeleton: Any
    head: bytes

    def hasher(self) -> Any:
        """An xxh64 that has seen every byte before the data area (the manifest's hash is
        of the whole file)."""
        h = xxhash.xxh64()
        h.update(self.head)
        return h


async def open_safetensors(store: Store, ref: BlobRef) -> SafetensorsInfo:
    """Read and check the header of safetensors blob ``ref`` (its length bounded by the
    blob's and 64 MiB, JSON, every entry inside the data and none overlapping) by ranged
    reads; its bytes are not hashed here: a caller trusts them only with the whole-file
    hash it checks (:func:`verify_blob`)."""
    size = ref.bytes
    head = await store.get_range(ref.key, 0, 8)
    hlen = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 <= hlen <= min(size - 8, 64 << 20):
        raise InvalidFormat(f"{ref.key}: safetensors header length {hlen} does not fit")
    raw_header = await store.get_range(ref.key, 8, hlen)
    try:
        header = json.loads(raw_header)
    except ValueError as err:
        raise InvalidFormat(f"{ref.key}: safetensors header is not JSON ({err})") from None
    start = 8 + hlen
    entries = _st_entries(header, size - start, ref.key)
    meta = header.get("__metadata__") or {}
    return SafetensorsInfo(entries, start, skeleton_of(meta, ref.key), head + raw_header)


def _check_shapes(key: str, live: Mapping[str, torch.Tensor],
                  saved: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Every saved tensor the live state also has must have its shape there."""
    for name, shape in saved:
        t = live.get(name)
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ShapeMismatch(f"{key}: tensor {name!r} is {list(t.shape)} here but was saved "
                                f"as {list(shape)}; nothing was written")


async def _decode_safetensors_into(store: Store, ref: BlobRef,
                                   live: Mapping[str, torch.Tensor], pool: Any, budget: int,
                                   progress: Progress,
                                   opened: Callable[[], Awaitable[None]] | None = None,
                                   ) -> tuple[Any, dict[str, torch.Tensor]]:
    """:func:`decode_into` for an uncompressed (safetensors) blob: its bytes are copied
    window by window straight into the live tensors (one native ``copy_batch`` per window,
    GIL released). A safetensors blob has no per-block hashes, only the manifest's xxh64 of
    the whole: the caller has checked it (:func:`verify_blob`) before this pass, and this
    pass hashes every byte again as it copies, so a blob that changed in between is caught
    (``ChecksumMismatch``; the live state is then partially overwritten)."""
    st = await open_safetensors(store, ref)
    start, entries, skeleton = st.data_start, st.entries, st.skeleton
    _check_shapes(ref.key, live, ((name, shape) for name, _, shape, _, _ in entries))
    if opened is not None:
        await opened()
    outs: list[tuple[int, int, int]] = []  # (begin, end, destination address)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, b, e in entries:
        target = live.get(name)
        view = None if target is None else inplace_view(target, dtype, shape)
        if view is None:
            view = np.empty(e - b, np.uint8)
            tensors[name] = tensor_from_bytes(view, dtype, shape, where=name)
        else:
            tensors[name] = target  # type: ignore[assignment]
        # the live tensors and ``tensors`` keep every destination alive while it is copied to
        outs.append((b, e, view.ctypes.data if view.size else 0))

    def copy(off: int, data: bytes) -> None:  # one window at a time, on a pool thread
        base = np.frombuffer(data, np.uint8).ctypes.data
        w0, w1 = off - start, off - start + len(data)
        jobs = [(base + max(b, w0) - w0, dst + max(b, w0) - b, min(e, w1) - max(b, w0))
                for b, e, dst in outs if b < w1 and e > w0 and dst]
        if ref.key not in progress.written:
            progress.written.append(ref.key)
        copy_batch(jobs)

    await copy_data_rehashed(store, ref, pool, budget, st, copy)
    mark_written(t for n, t in tensors.items() if live.get(n) is t)
    return skeleton, tensors


async def copy_data_rehashed(store: Store, ref: BlobRef, pool: Any, budget: int,
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


def _windows(blocks: list[BlockRef], window: int) -> list[tuple[tuple[int, int], list[BlockRef]]]:
    """Consecutive blocks grouped into reads of at most ``window`` bytes (a block larger
    than the window is read alone)."""
    out: list[tuple[tuple[int, int], list[BlockRef]]] = []
    for b in blocks:
        if out:
            (off, ln), group = out[-1]
            if off + ln == b.offset and ln + b.length <= window:
                out[-1] = ((off, ln + b.length), [*group, b])
                continue
        out.append(((b.offset, b.length), [b]))
    return out
