"""Restores of sharded items from their saved pieces, on any world size and mesh, written
straight into this rank's live local shards with memory bounded by the in-flight budget.

A sharded item (FSDP2 ``fully_shard``, tensor parallel, ``ShardedModel`` /
``ShardedOptimizer``) is saved as one blob per rank, each holding that rank's piece of every
tensor (the manifest's ``pieces``). A restore of such an item goes in two steps:

- :func:`open_item`, nothing written: for every tensor the live global shape and dtype must be
  the saved ones (``ShapeMismatch`` naming it), the saved pieces must cover the box this rank
  holds (:func:`~mithril_async.pipeline.reshard.plan_reads`: ``MissingPrevious`` naming the
  tensor and the hole), and every blob the plan reads must exist with its recorded size
  (``MissingPrevious`` naming the rank and the blob). Then each of those blobs is opened: an
  MCKP blob's trailer, header and index by their own hashes, its blocks tiling its data area
  and its header's step and item the manifest's (``verify = "block"``), or the whole blob
  verified first (``"whole"``); an uncompressed (safetensors) blob verified whole in both
  modes (it has no per-block hashes); and every tensor taken from it must have the dtype and
  shape the manifest records for its piece. A blob that is a delta or references other
  versions is decoded here, whole, into fresh tensors (verified as any read).
- :func:`write_item`: every opened blob streams only the chunks covering what this rank needs
  (ranged reads in windows of a few MiB, :func:`~mithril_async.pipeline.inplace.decode_blocks`),
  every block verified before its bytes are used, and the copy runs of each decoded chunk
  (:func:`~mithril_async.pipeline.reshard.copy_runs`) go straight into the live shards; a
  chunk that lies inside one run (a ``Shard(0)`` layout) is decoded straight into the live
  shard's memory. Uncompressed blobs are read once more in order, hashed again as their runs
  are copied (a blob changed since its verifying pass is caught).

So a restore from pieces holds a few windows and one chunk per codec thread beyond the live
state, whatever the state's size (only blobs decoded whole, above, are held whole). Damage
found before the first write leaves the live state untouched and raises its own typed error;
after it (``"block"``: a damaged block; either mode: a blob that changed between two reads),
:class:`~mithril_async.errors.RestoreIncomplete` naming what was written (the caller's
``guard_writes``), and ``restore(fallback=True)`` writes an older version over every item
touched, as for a same-layout restore.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mithril_async.codec.container import BlockRef, MckpInfo
from mithril_async.codec.kernels import copy_arrays
from mithril_async.errors import (
    InvalidFormat,
    KeyNotFound,
    MissingPrevious,
    ShapeMismatch,
)
from mithril_async.manifest import ShardRef
from mithril_async.pipeline.blobs import BlobCodec, LoadBlob, skeleton_of
from mithril_async.pipeline.inplace import (
    Progress,
    SafetensorsInfo,
    check_binding,
    check_tiling,
    copy_data_rehashed,
    decode_blocks,
    mark_written,
    open_mckp,
    open_safetensors,
    settled,
    takes_in_place,
    verify_blob,
)
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.pipeline.reshard import Box, SavedPiece, copy_runs, plan_reads
from mithril_async.storage.base import Store

__all__ = ["OpenedItem", "open_item", "write_item"]


@dataclass
class _Runs:
    """The copy runs of one tensor from one saved piece: ``(src, dst, nbytes)`` byte offsets
    in the piece and in the live local shard (sorted by ``src``, never overlapping), and the
    live shard's bytes."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    live: np.ndarray  # uint8 view of the live local shard
    ends: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.ends = self.src + self.nbytes

    @classmethod
    def of(cls, runs: np.ndarray, live: torch.Tensor) -> _Runs:
        view = live.reshape(-1).view(torch.uint8).numpy() if live.numel() else \
            np.empty(0, np.uint8)
        return cls(runs[:, 0].copy(), runs[:, 1].copy(), runs[:, 2].copy(), view)

    @property
    def span(self) -> tuple[int, int]:
        """The bytes of the piece the runs lie in."""
        return int(self.src.min()), int(self.ends.max())

    def inside_one(self, lo: int, n: int) -> np.ndarray | None:
        """The live shard's bytes for piece bytes ``[lo, lo + n)`` when they lie inside one
        run (a chunk decoded straight into the live shard); None otherwise."""
        i = int(np.searchsorted(self.src, lo, side="right")) - 1
        if i < 0 or lo + n > int(self.ends[i]):
            return None
        at = int(self.dst[i] + lo - self.src[i])
        out: np.ndarray = self.live[at:at + n]
        return out

    def copy_from(self, lo: int, data: np.ndarray) -> None:
        """Copy the runs' parts that lie in piece bytes ``[lo, lo + len(data))`` from
        ``data`` into the live shard (one native batched copy, GIL released)."""
        hi = lo + data.size
        a = int(np.searchsorted(self.ends, lo, side="right"))
        b = int(np.searchsorted(self.src, hi, side="left"))
        if a >= b:
            return
        s, d, n = self.src[a:b], self.dst[a:b], self.nbytes[a:b]
        start = np.maximum(s, lo)
        count = np.minimum(s + n, hi) - start
        keep = count > 0
        base_src, base_dst = data.ctypes.data, self.live.ctypes.data
        copy_arrays((base_src + start - lo)[keep].astype(np.uint64),
                    (base_dst + d + start - s)[keep].astype(np.uint64),
                    count[keep].astype(np.uint64))


@dataclass
class _Source:
    """One saved rank's blob of the item and what this rank takes from it."""

    rank: int
    ref: ShardRef
    runs: dict[str, _Runs] = field(default_factory=dict)
    mckp: MckpInfo | None = None
    st: SafetensorsInfo | None = None
    #: a blob decoded whole by the codec (a delta, or one referencing other versions)
    tensors: dict[str, torch.Tensor] | None = None


@dataclass
class OpenedItem:
    """One sharded item of a restore, planned and checked, nothing written yet: its state
    skeleton (the lowest saved rank's) and the saved blobs :func:`write_item` streams."""

    item: str
    skeleton: Any
    sources: list[_Source]
    targets: Mapping[str, Any]  # name -> distributed.ShardTarget


async def open_item(codec: BlobCodec, store: Store, version: str, step: int, item: str,
                    refs: Mapping[int, ShardRef], targets: Mapping[str, Any],
                    load_blob: LoadBlob, budget: int, verify: str) -> OpenedItem:
    """Plan and check what item ``item`` needs from its saved pieces to fill ``targets``
    (name -> ``ShardTarget``) and open every blob it reads (see the module docstring);
    nothing is written."""
    reads = {}
    for name, tgt in targets.items():
        pieces = [SavedPiece(r, Box.of(p.offsets, p.lengths), p.replicated)
                  for r, ref in refs.items() if (p := ref.pieces.get(name)) is not None]
        for r, ref in refs.items():
            p = ref.pieces.get(name)
            if p is not None and list(p.global_shape) != list(tgt.global_shape):
                raise ShapeMismatch(f"{item}: tensor {name!r} is {list(tgt.global_shape)} here "
                                    f"but rank {r} saved it as part of {p.global_shape}")
        reads[name] = plan_reads(f"{item}/{name}", tgt.box, pieces)
    sources = {min(refs): _Source(min(refs), refs[min(refs)])}  # it has the skeleton
    for name, rds in reads.items():
        tgt = targets[name]
        for rd in rds:
            src = sources.setdefault(rd.rank, _Source(rd.rank, refs[rd.rank]))
            runs = copy_runs(rd.src, tgt.box, rd.overlap, tgt.local.element_size())
            src.runs[name] = _Runs.of(runs, tgt.local)
    for src in sources.values():  # every blob the plan reads exists, before any read
        try:
            size = await store.size(src.ref.key)
        except KeyNotFound:
            what = f"tensor {next(iter(src.runs))!r}" if src.runs else "the state skeleton"
            raise MissingPrevious(f"{version}: rank {src.rank}'s {item} blob {src.ref.key} "
                                  f"(holding {what}) is missing") from None
        if size != src.ref.bytes:
            raise InvalidFormat(f"{src.ref.key}: {size} bytes, manifest says {src.ref.bytes}")
    order = sorted(sources)
    share = max(1, budget // len(order))  # blobs verified whole stream concurrently
    skeletons = await all_or_first_error([
        _open_source(codec, store, sources[r], step, item, targets, load_blob, share, verify)
        for r in order])
    return OpenedItem(item, skeletons[0], [sources[r] for r in order], targets)


async def _open_source(codec: BlobCodec, store: Store, src: _Source, step: int, item: str,
                       targets: Mapping[str, Any], load_blob: LoadBlob, budget: int,
                       verify: str) -> Any:
    """Open one saved blob (see :func:`open_item`); its state skeleton."""
    ref = src.ref
    if takes_in_place(ref) and ref.format == "mckp":
        if verify == "whole":
            await verify_blob(store, ref, codec.pool, budget)
        info = await open_mckp(store, ref, ref.bytes)
        check_tiling(ref.key, info, sorted(info.index.values(), key=lambda b: b.offset))
        check_binding(ref.key, info, step, item)
        found = {t.name: (t.dtype, tuple(t.shape)) for t in info.tensors}
        src.mckp = info
        skeleton = skeleton_of(info.metadata, ref.key)
    elif takes_in_place(ref):  # safetensors: one whole-file hash, checked before any use
        await verify_blob(store, ref, codec.pool, budget)
        st = await open_safetensors(store, ref)
        found = {name: (dtype, shape) for name, dtype, shape, _, _ in st.entries}
        src.st = st
        skeleton = st.skeleton
    else:
        skeleton, tensors = await codec.read(store, ref, load_blob,
                                             only=frozenset(src.runs))
        found = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                 for n, t in tensors.items()}
        src.tensors = {n: t.contiguous() for n, t in tensors.items()}
    for name in src.runs:
        want = (str(targets[name].dtype).removeprefix("torch."),
                tuple(ref.pieces[name].lengths))
        got = found.get(name)
        if got is None:
            raise InvalidFormat(f"{item}: rank {src.rank}'s blob lacks tensor {name!r} its "
                                "manifest entry lists")
        if got != want:
            raise InvalidFormat(f"{item}: rank {src.rank}'s tensor {name!r} is "
                                f"{got[0]}{list(got[1])}, its manifest entry says "
                                f"{want[0]}{list(want[1])}")
    return skeleton


async def write_item(opened: OpenedItem, store: Store, pool: Any, budget: int,
                     progress: Progress) -> None:
    """Stream every opened blob's needed bytes into the live local shards (see the module
    docstring); the blobs concurrently, the budget shared among them."""
    share = max(1, budget // max(1, len(opened.sources)))
    try:
        await all_or_first_error([_write_source(opened.item, src, store, pool, share,
                                                progress) for src in opened.sources
                                  if src.runs])
    finally:  # what was written is written, whatever stopped the rest
        if opened.item in progress.items:
            mark_written(t.local for t in opened.targets.values())


def _started(item: str, key: str, progress: Progress) -> Any:
    lock = threading.Lock()

    def started() -> None:  # on a pool thread: the first write of this blob is next
        with lock:
            if key not in progress.written:
                progress.written.append(key)
            progress.items.add(item)

    return started


async def _write_source(item: str, src: _Source, store: Store, pool: Any, budget: int,
                        progress: Progress) -> None:
    started = _started(item, src.ref.key, progress)
    if src.mckp is not None:
        await _write_mckp(src, src.mckp, store, pool, budget, started)
    elif src.st is not None:
        await _write_safetensors(src, src.st, store, pool, budget, started)
    else:
        assert src.tensors is not None
        tensors = src.tensors

        def copy_all() -> None:
            started()
            for name, runs in src.runs.items():
                t = tensors[name]
                runs.copy_from(0, t.reshape(-1).view(torch.uint8).numpy() if t.numel()
                               else np.empty(0, np.uint8))

        await settled(pool, [(copy_all, ())])


async def _write_mckp(src: _Source, info: MckpInfo, store: Store, pool: Any, budget: int,
                      started: Any) -> None:
    """Decode the chunks covering each needed span of an MCKP piece: straight into the live
    shard where a chunk lies inside one run, else into a per-thread scratch buffer whose
    runs are copied out right after."""
    index = {t.name: ti for ti, t in enumerate(info.tensors)}
    by_tensor: dict[int, _Runs] = {}
    blocks: list[BlockRef] = []
    for name, runs in src.runs.items():
        ti = index[name]
        by_tensor[ti] = runs
        lo, hi = runs.span
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

    await decode_blocks(store, src.ref.key, info, blocks, dest, pool, budget, started,
                        after=after)


async def _write_safetensors(src: _Source, st: SafetensorsInfo, store: Store, pool: Any,
                             budget: int, started: Any) -> None:
    """Read an uncompressed piece again in order, hashing every byte
    (:func:`~mithril_async.pipeline.inplace.copy_data_rehashed`), and copy each needed
    tensor's runs out of the windows."""
    ranges = [(st.data_start + b, st.data_start + e, src.runs[name])
              for name, _dtype, _shape, b, e in st.entries if name in src.runs]

    def copy(off: int, data: bytes) -> None:
        buf = np.frombuffer(data, np.uint8)
        end = off + buf.size
        for b, e, runs in ranges:
            lo, hi = max(b, off), min(e, end)
            if lo < hi:
                started()
                runs.copy_from(lo - b, buf[lo - off:hi - off])

    await copy_data_rehashed(store, src.ref, pool, budget, st, copy)
