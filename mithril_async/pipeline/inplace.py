"""Restores that write straight into the live tensors, with memory bounded by the pipeline's
in-flight budget, whatever the state's size.

Same layout (:func:`verify_blob`, then :func:`decode_into`): every blob of the version is
first verified whole, streamed in windows of a few MiB (size and the manifest's XXH64), with
nothing written; then read again by ranges and decoded straight into the live tensors' memory
(MCKP: each block's header and payload hash checked again before a byte of it is decoded, its
decoded bytes' hash after) or, uncompressed (``.safetensors``), copied there by one native
``copy_batch`` per window (GIL released, no ``torch.Tensor.copy_``) while its bytes are hashed
again. A live tensor of another shape is :class:`~mithril_async.errors.ShapeMismatch` before
any item writes; one of another dtype, not contiguous or not on the CPU is decoded into a
fresh tensor as before (``load_state_dict`` then converts it).

Sharded state on any world size and mesh (:func:`prepare_pieces`, then :func:`apply_pieces`):
for every tensor, before anything is read, the live global shape and dtype must be the saved
ones (``ShapeMismatch`` naming the tensor), the saved pieces must cover the box this rank holds
(:func:`~mithril_async.pipeline.reshard.plan_reads`: ``MissingPrevious`` naming the tensor and
the hole), and every blob the plan reads must exist with its recorded size (``MissingPrevious``
naming the rank and the blob). Then each saved rank's blob gives only the chunks covering the
span this rank needs of each tensor (:func:`read_spans`; ranged reads, every block hashed),
all of them concurrently, and only when every item is decoded are the overlaps copied into the
live local shards (one ``copy_batch`` per item).

Guarantee: a damaged or missing blob, piece or RNG file leaves the live state untouched and
raises its own typed error (so ``restore(fallback=True)`` can move on to an older version). A
failure after the first byte was written (a blob that changed between the verifying and the
decoding pass, a decode whose verified payload does not give the recorded bytes) raises
:class:`~mithril_async.errors.RestoreIncomplete`: partially overwritten, never returned as if
restored. Tensors written here have their autograd version counter bumped, as ``copy_`` would.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from mithril_async.codec.chunk import decode_chunk
from mithril_async.codec.container import (
    FLAG_DELTA,
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
    KeyNotFound,
    MissingPrevious,
    RestoreIncomplete,
    ShapeMismatch,
)
from mithril_async.manifest import BlobRef, ShardRef
from mithril_async.pipeline.blobs import REFS_KEY, SKELETON_KEY, BlobCodec, LoadBlob
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.pipeline.reshard import Box, Read, SavedPiece, copy_runs, plan_reads
from mithril_async.storage.base import Store

__all__ = ["PreparedPieces", "Progress", "apply_pieces", "decode_into", "guard_writes",
           "inplace_view", "mark_written", "prepare_pieces", "takes_in_place", "verify_blob"]


@dataclass
class Progress:
    """What a restore has written into the live state so far (for its failure message)."""

    written: list[str] = field(default_factory=list)

    @property
    def touched(self) -> bool:
        return bool(self.written)


@dataclass
class _Want:
    target: Any  # distributed.ShardTarget
    reads: list[Read]


@dataclass
class PreparedPieces:
    """One item of a restore from pieces, decoded and planned, not yet written: its state
    skeleton and the copies ``(src, dst, nbytes)`` from the decoded pieces (``keep``) into
    the live local shards."""

    item: str
    skeleton: Any
    ranks: int
    jobs: list[tuple[int, int, int]] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)


async def prepare_pieces(codec: BlobCodec, store: Store, version: str, item: str,
                         refs: Mapping[int, ShardRef], targets: Mapping[str, Any],
                         load_blob: LoadBlob, budget: int) -> PreparedPieces:
    """Plan, read, verify and decode what item ``item`` needs from its saved pieces to fill
    ``targets`` (name -> ``ShardTarget``); write nothing (:func:`apply_pieces` does). The
    skeleton comes from the lowest saved rank's blob."""
    wants: dict[str, _Want] = {}
    for name, tgt in targets.items():
        pieces = [SavedPiece(r, Box.of(p.offsets, p.lengths), p.replicated)
                  for r, ref in refs.items() if (p := ref.pieces.get(name)) is not None]
        for r, ref in refs.items():
            p = ref.pieces.get(name)
            if p is not None and list(p.global_shape) != list(tgt.global_shape):
                raise ShapeMismatch(f"{item}: tensor {name!r} is {list(tgt.global_shape)} here "
                                    f"but rank {r} saved it as part of {p.global_shape}")
        wants[name] = _Want(tgt, plan_reads(f"{item}/{name}", tgt.box, pieces))
    by_rank: dict[int, list[str]] = {min(refs): []}  # the lowest rank supplies the skeleton
    for name, want in wants.items():
        for rd in want.reads:
            names = by_rank.setdefault(rd.rank, [])
            if name not in names:
                names.append(name)
    for r, names in by_rank.items():  # every blob the plan reads exists, before any read
        ref = refs[r]
        try:
            size = await store.size(ref.key)
        except KeyNotFound:
            what = f"tensor {names[0]!r}" if names else "the state skeleton"
            raise MissingPrevious(f"{version}: rank {r}'s {item} blob {ref.key} (holding "
                                  f"{what}) is missing") from None
        if size != ref.bytes:
            raise InvalidFormat(f"{ref.key}: {size} bytes, manifest says {ref.bytes}")
    # the runs each saved piece supplies, and the byte span of the piece they lie in: only
    # the chunks covering that span are read and decoded (a 2 -> 4 reshard reads half of each
    # saved piece, not all of it)
    runs: dict[int, list[tuple[str, Read, np.ndarray]]] = {r: [] for r in by_rank}
    spans: dict[int, dict[str, tuple[int, int]]] = {r: {} for r in by_rank}
    for name, want in wants.items():
        itemsize = want.target.local.element_size()
        for rd in want.reads:
            rr = copy_runs(rd.src, want.target.box, rd.overlap, itemsize)
            runs[rd.rank].append((name, rd, rr))
            lo, hi = int(rr[:, 0].min()), int((rr[:, 0] + rr[:, 2]).max())
            old = spans[rd.rank].get(name)
            spans[rd.rank][name] = (lo, hi) if old is None else (min(lo, old[0]),
                                                                 max(hi, old[1]))
    order = sorted(by_rank)

    async def read_rank(r: int) -> tuple[Any, dict[str, tuple[int, np.ndarray, str,
                                                          tuple[int, ...]]]]:
        got = await read_spans(store, refs[r], spans[r], codec.pool, budget)
        if got is not None:
            return got
        skel, tensors = await codec.read(store, refs[r], load_blob, only=frozenset(spans[r]))
        out = {}
        for name in spans[r]:
            t = tensors.get(name)
            if t is None:
                raise InvalidFormat(f"{item}: rank {r}'s blob lacks tensor {name!r} its "
                                    "manifest entry lists")
            t = t.contiguous()
            out[name] = (0, t.reshape(-1).view(torch.uint8).numpy() if t.numel() else
                         np.empty(0, np.uint8), str(t.dtype).removeprefix("torch."),
                         tuple(t.shape))
        return skel, out

    # every saved rank's blob read concurrently; nothing is written until every item of the
    # restore is decoded (the caller copies with apply_pieces)
    got = await all_or_first_error([read_rank(r) for r in order])
    out = PreparedPieces(item, got[0][0], len(order))  # the lowest rank's skeleton
    for r, (_skel, pieces) in zip(order, got, strict=True):
        for name, rd, rr in runs[r]:
            start, buf, dtype, shape = pieces[name]
            target = wants[name].target
            if shape != rd.src.lengths or dtype != str(target.dtype).removeprefix("torch."):
                raise InvalidFormat(f"{item}: rank {r}'s tensor {name!r} is {dtype}{list(shape)}"
                                    f", its manifest entry says {target.dtype}"
                                    f"{list(rd.src.lengths)}")
            out.keep.append(buf)
            s0, d0 = buf.ctypes.data - start, target.local.data_ptr()
            out.jobs.extend((s0 + a, d0 + b, n) for a, b, n in rr.tolist())
    return out


async def apply_pieces(prepared: list[PreparedPieces], targets: Mapping[str, Mapping[str, Any]],
                       pool: Any, progress: Progress) -> None:
    """Copy every prepared item's overlaps into the live local shards: one native batched
    copy per item (GIL released, no ``torch.Tensor.copy_``)."""
    loop = asyncio.get_running_loop()
    for p in prepared:
        progress.written.append(f"{p.item} (from {p.ranks} saved rank(s))")
        await loop.run_in_executor(pool, copy_batch, p.jobs)
        p.jobs, p.keep = [], []
        mark_written(t.local for t in targets[p.item].values())


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
                      ) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """Decode MCKP blob ``ref`` straight into the live tensors ``live`` (by stored name),
    streaming its blocks in windows (:func:`window_plan`: a few MiB each, as many in flight
    as keep the codec threads busy within ``budget`` bytes); return ``(skeleton, tensors)``,
    where a tensor written in place *is* the live one. An uncompressed (safetensors) blob is
    copied in the same way (:func:`_decode_safetensors_into`). None when the blob is not one
    this path takes (:func:`takes_in_place`): the caller decodes it the usual way.

    The caller has verified the whole blob first (:func:`verify_blob`); this pass checks the
    trailer, header and index by their own hashes, every block's header and payload hash
    again before any byte of it is decoded into a live tensor (a blob changed since the
    verifying pass is caught there), and its decoded bytes' hash right after. A tensor the
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

    info = await _open_mckp(store, ref, size)
    skeleton = _skeleton_of(info, ref.key)
    _check_shapes(ref.key, live, ((t.name, t.shape) for t in info.tensors))
    if opened is not None:
        await opened()
    outs: list[np.ndarray] = []
    tensors: dict[str, torch.Tensor] = {}
    fresh: list[int] = []
    for ti, t in enumerate(info.tensors):
        target = live.get(t.name)
        view = None if target is None else inplace_view(target, t.dtype, t.shape)
        if view is None:
            view = np.empty(t.nbytes, np.uint8)
            fresh.append(ti)
        else:
            tensors[t.name] = target  # type: ignore[assignment]
        outs.append(view)

    def dest(b: BlockRef) -> np.ndarray:
        off, ln = info.tensors[b.tensor].chunks[b.chunk]
        return outs[b.tensor][off:off + ln]

    def started() -> None:
        if not progress.written or progress.written[-1] != ref.key:
            progress.written.append(ref.key)

    await _decode_blocks(store, ref.key, info, list(info.index.values()), dest, pool, budget,
                         started)
    mark_written(t for n, t in tensors.items() if live.get(n) is t)
    for ti in fresh:
        t = info.tensors[ti]
        tensors[t.name] = tensor_from_bytes(outs[ti], t.dtype, t.shape, where=t.name)
    return skeleton, tensors


async def _open_mckp(store: Store, ref: BlobRef, size: int) -> MckpInfo:
    """Trailer, header and index of MCKP blob ``ref`` by ranged reads, each checked by its
    own hash; a blob that is a delta or references tensors its manifest entry does not name,
    or declares other raw bytes than recorded, is :class:`InvalidFormat`."""

    async def read_range(offset: int, length: int) -> bytes:
        return await store.get_range(ref.key, offset, length)

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


async def _decode_blocks(store: Store, key: str, info: MckpInfo, blocks: list[BlockRef],
                         dest: Callable[[BlockRef], np.ndarray], pool: Any, budget: int,
                         started: Callable[[], None] = lambda: None) -> None:
    """Read ``blocks`` of blob ``key`` (adjacent ones merged into reads of a few MiB, as many
    in flight as :func:`window_plan` allows within ``budget``) and decode each into
    ``dest(block)`` on ``pool``: its header and payload hash checked before a byte of it is
    decoded, its decoded bytes' hash after. ``started()`` runs before the first decode."""
    window, depth = window_plan(budget, _threads(pool))
    windows = _windows(sorted(blocks, key=lambda r: r.offset), window)
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(depth)  # windows read and not yet decoded: the memory bound

    def work(b: BlockRef, mv: memoryview, base: int) -> None:
        meta, payload = block_from_bytes(mv[b.offset - base:b.offset - base + b.length], b,
                                         info, verify_payload=True)
        decode_chunk(payload, meta, None, dest(b),
                     where=f"{key}: {info.block_name(b.tensor, b.chunk)}",
                     verify_payload=False)

    async def one(span: tuple[int, int], wblocks: list[BlockRef]) -> None:
        async with slots:
            data = await store.get_range(key, *span)
            if len(data) != span[1]:
                raise InvalidFormat(f"{key}: ranged read of {span[1]} bytes at {span[0]} "
                                    f"returned {len(data)}")
            mv = memoryview(data).cast("B")
            started()
            await asyncio.gather(*(loop.run_in_executor(pool, work, b, mv, span[0])
                                   for b in wblocks))

    await all_or_first_error([one(span, wblocks) for span, wblocks in windows])


async def read_spans(store: Store, ref: BlobRef, spans: Mapping[str, tuple[int, int]],
                     pool: Any, budget: int
                     ) -> tuple[Any, dict[str, tuple[int, np.ndarray, str, tuple[int, ...]]]] \
        | None:
    """Only the bytes ``[lo, hi)`` of each named tensor of MCKP blob ``ref``: the chunks
    covering them, read by ranges and decoded (every block's hashes checked, as ever).
    Returns the blob's state skeleton and ``name -> (start, bytes, dtype, shape)`` where
    ``bytes`` holds the tensor's bytes
    from ``start`` (a chunk boundary at or below ``lo``) to a chunk boundary at or above
    ``hi``. None for a blob this path does not take (not MCKP, a delta, references): the
    caller reads it through the codec, whole."""
    if not takes_in_place(ref) or ref.format != "mckp":
        return None
    size = await store.size(ref.key)
    if size != ref.bytes:
        raise InvalidFormat(f"{ref.key}: {size} bytes, manifest says {ref.bytes}")
    info = await _open_mckp(store, ref, size)
    index = {t.name: ti for ti, t in enumerate(info.tensors)}
    out: dict[str, tuple[int, np.ndarray, str, tuple[int, ...]]] = {}
    where: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # block -> (buffer, its start)
    for name, (lo, hi) in spans.items():
        ti = index.get(name)
        if ti is None:
            raise InvalidFormat(f"{ref.key}: lacks tensor {name!r} its manifest entry lists")
        t = info.tensors[ti]
        need = [(ci, off, ln) for ci, (off, ln) in enumerate(t.chunks)
                if off < hi and off + ln > lo]
        start = need[0][1] if need else 0
        buf = np.empty((need[-1][1] + need[-1][2] - start) if need else 0, np.uint8)
        for ci, _off, _ln in need:
            where[(ti, ci)] = (buf, start)
        out[name] = (start, buf, t.dtype, t.shape)

    def dest(b: BlockRef) -> np.ndarray:
        buf, start = where[(b.tensor, b.chunk)]
        off, ln = info.tensors[b.tensor].chunks[b.chunk]
        return buf[off - start:off - start + ln]

    await _decode_blocks(store, ref.key, info, [info.index[k] for k in where], dest, pool,
                         budget)
    return _skeleton_of(info, ref.key), out


#: bytes per ranged read of a streamed restore: small enough that a window read is still in
#: the CPU cache when it is hashed or decoded (64 MiB windows read at a fifth of the speed
#: of 4 MiB ones here), big enough that a read's per-call cost vanishes
WINDOW = 4 << 20


def window_plan(budget: int, threads: int) -> tuple[int, int]:
    """``(window bytes, windows in flight)`` for a restore allowed ``budget`` bytes in
    flight: :data:`WINDOW`-sized reads, as many in flight as keep every codec thread busy
    (two per thread, at least 3) and fit the budget (at least 2)."""
    depth = max(2, min(max(3, 2 * threads), budget // WINDOW))
    return WINDOW, depth


async def _ordered(spans: list[tuple[int, int]], read: Any, depth: int,
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
    window, depth = window_plan(budget, _threads(pool))

    async def read(off: int, ln: int) -> bytes:
        return await store.get_range(ref.key, off, ln)

    async def update(_off: int, data: bytes) -> None:
        await loop.run_in_executor(pool, h.update, data)

    await _ordered([(o, min(window, size - o)) for o in range(0, size, window)], read, depth,
                   update, ref.key)
    got = h.hexdigest()
    if got != ref.xxh64:
        raise ChecksumMismatch(ref.key, ref.xxh64, got)


def _threads(pool: Any) -> int:
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
    size = ref.bytes
    head = await store.get_range(ref.key, 0, 8)
    hlen = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 <= hlen <= min(size - 8, 64 << 20):
        raise InvalidFormat(f"{ref.key}: safetensors header length {hlen} does not fit")
    raw_header = await store.get_range(ref.key, 8, hlen)
    h = xxhash.xxh64()
    h.update(head)
    h.update(raw_header)
    try:
        header = json.loads(raw_header)
    except ValueError as err:
        raise InvalidFormat(f"{ref.key}: safetensors header is not JSON ({err})") from None
    start = 8 + hlen
    entries = _st_entries(header, size - start, ref.key)
    meta = header.get("__metadata__") or {}
    skeleton = json.loads(meta[SKELETON_KEY]) if isinstance(meta.get(SKELETON_KEY), str) \
        else None
    if skeleton is None:
        raise InvalidFormat(f"{ref.key}: blob has no state skeleton")
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
    loop = asyncio.get_running_loop()
    window, depth = window_plan(budget, _threads(pool))

    async def read(off: int, ln: int) -> bytes:
        return await store.get_range(ref.key, off, ln)

    async def copy(off: int, data: bytes) -> None:
        base = np.frombuffer(data, np.uint8).ctypes.data
        w0, w1 = off - start, off - start + len(data)
        jobs = [(base + max(b, w0) - w0, dst + max(b, w0) - b, min(e, w1) - max(b, w0))
                for b, e, dst in outs if b < w1 and e > w0 and dst]
        if not progress.written or progress.written[-1] != ref.key:
            progress.written.append(ref.key)
        await asyncio.gather(loop.run_in_executor(pool, copy_batch, jobs),
                             loop.run_in_executor(pool, h.update, data))

    await _ordered([(o, min(window, size - o)) for o in range(start, size, window)], read,
                   depth, copy, ref.key)
    mark_written(t for n, t in tensors.items() if live.get(n) is t)
    got = h.hexdigest()
    if got != ref.xxh64:
        raise ChecksumMismatch(f"{ref.key} (changed while it was restored)", ref.xxh64, got)
    return skeleton, tensors


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


def _skeleton_of(info: MckpInfo, where: str) -> Any:
    raw = info.metadata.get(SKELETON_KEY)
    if not isinstance(raw, str):
        raise InvalidFormat(f"{where}: blob has no state skeleton")
    try:
        return json.loads(raw)
    except ValueError as err:
        raise InvalidFormat(f"{where}: state skeleton is not JSON ({err})") from None
