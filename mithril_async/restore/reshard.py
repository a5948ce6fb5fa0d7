"""Which stored pieces of a sharded tensor a rank needs, and which bytes go where: pure math.

A sharded tensor (a DTensor of FSDP2 ``fully_shard``, tensor parallel, ``ShardedModel`` /
``ShardedOptimizer``) is saved as one *piece* per rank: a box ``[offset, offset + length)`` in
every dimension of its global shape (the manifest records it, ``PieceMeta``). A restore on
another world size or mesh needs other boxes. For each tensor this module computes

- :func:`plan_reads`: which saved pieces overlap the box a rank needs (a replicated piece, held
  by several ranks, is read once, from the lowest rank), and that together they cover it:
  a box the saved pieces leave uncovered is :class:`~mithril_async.errors.MissingPrevious`
  naming the tensor and the hole, before anything is read or written;
- :func:`copy_runs`: for one overlap, the contiguous byte runs ``(src_offset, dst_offset,
  nbytes)`` from the saved piece's row-major bytes to the live local tensor's (whole trailing
  dimensions merged into one run), for the native batched copy.

No I/O, no torch: the restore plan (:mod:`mithril_async.restore.plan`) uses it, and the
executor does the reading and copying.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mithril_async.errors import InvalidFormat, MissingPrevious

__all__ = ["Box", "Read", "SavedPiece", "copy_runs", "plan_reads", "row_major_strides"]


@dataclass(frozen=True)
class Box:
    """``[offsets[d], offsets[d] + lengths[d])`` in every dimension ``d`` of a global tensor."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, offsets: Iterable[int], lengths: Iterable[int]) -> Box:
        o, ln = tuple(int(x) for x in offsets), tuple(int(x) for x in lengths)
        if len(o) != len(ln):
            raise ValueError(f"box with {len(o)} offsets and {len(ln)} lengths")
        return cls(o, ln)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes of the same tensor; None when it is empty."""
        if len(self.offsets) != len(other.offsets):
            raise ValueError(f"boxes of {len(self.offsets)} and {len(other.offsets)} dims")
        off, ln = [], []
        for a, la, b, lb in zip(self.offsets, self.lengths, other.offsets, other.lengths,
                                strict=True):
            lo, hi = max(a, b), min(a + la, b + lb)
            if hi <= lo:
                return None
            off.append(lo)
            ln.append(hi - lo)
        return Box(tuple(off), tuple(ln))

    def __str__(self) -> str:
        if not self.offsets:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths,
                                                               strict=True)) + "]"


@dataclass(frozen=True)
class SavedPiece:
    """One stored piece: the saved rank whose blob holds it, and its box."""

    rank: int
    box: Box
    replicated: bool = False


@dataclass(frozen=True)
class Read:
    """Part of a needed box that one saved piece supplies."""

    rank: int
    #: the saved piece's box (global coordinates)
    src: Box
    #: the overlap with the needed box (global coordinates)
    overlap: Box


def plan_reads(name: str, need: Box, pieces: Sequence[SavedPiece]) -> list[Read]:
    """The saved pieces overlapping ``need`` and the overlap of each, lowest rank first.

    Identical boxes held by several ranks (replicas) are read once, from the lowest rank.
    The overlaps must tile ``need`` exactly: saved pieces that overlap each other (a damaged
    manifest) are :class:`InvalidFormat`; a part of ``need`` no piece holds is
    :class:`MissingPrevious` naming the tensor and how much is missing.
    """
    unique: dict[Box, SavedPiece] = {}
    for p in sorted(pieces, key=lambda p: p.rank):
        if len(p.box.offsets) != len(need.offsets):
            raise InvalidFormat(f"tensor {name!r}: saved piece of rank {p.rank} has "
                                f"{len(p.box.offsets)} dims, the tensor has {len(need.offsets)}")
        unique.setdefault(p.box, p)
    reads: list[Read] = []
    covered = 0
    for box, p in unique.items():
        ov = box.intersect(need)
        if ov is None:
            continue
        for r in reads:
            if r.overlap.intersect(ov) is not None:
                raise InvalidFormat(f"tensor {name!r}: saved pieces {r.src} (rank {r.rank}) "
                                    f"and {box} (rank {p.rank}) overlap")
        reads.append(Read(p.rank, box, ov))
        covered += ov.numel
    if covered != need.numel:
        raise MissingPrevious(
            f"tensor {name!r}: the saved pieces cover {covered} of the {need.numel} elements "
            f"of {need} this rank needs (saved: "
            f"{', '.join(f'rank {p.rank} {b}' for b, p in unique.items()) or 'none'}); a "
            "rank's piece is missing from the version")
    return reads


def row_major_strides(lengths: Sequence[int]) -> list[int]:
    """Element strides of a contiguous row-major tensor of shape ``lengths``."""
    out = [1] * len(lengths)
    for d in range(len(lengths) - 2, -1, -1):
        out[d] = out[d + 1] * lengths[d + 1]
    return out


def copy_runs(src: Box, dst: Box, overlap: Box, itemsize: int) -> np.ndarray:
    """Contiguous byte runs copying ``overlap`` from piece ``src`` to piece ``dst``.

    Both pieces are contiguous row-major tensors of their box's lengths. Returns an
    ``(R, 3)`` int64 array of ``(src_offset, dst_offset, nbytes)``, sorted by source offset;
    trailing dimensions the overlap spans whole in both pieces merge into one run (a
    ``Shard(0)`` -> ``Shard(0)`` reshard is a single run per piece).
    """
    n = len(overlap.offsets)
    if n == 0:  # a 0-d tensor: one element
        return np.array([[0, 0, itemsize]], dtype=np.int64)
    # k: the first dimension of the contiguous run; dims after k are whole in all three
    k = n - 1
    while k > 0 and overlap.lengths[k] == src.lengths[k] == dst.lengths[k]:
        k -= 1
    run = overlap.lengths[k] * math.prod(overlap.lengths[k + 1:])
    ss, ds = row_major_strides(src.lengths), row_major_strides(dst.lengths)
    s0 = sum((overlap.offsets[d] - src.offsets[d]) * ss[d] for d in range(n))
    d0 = sum((overlap.offsets[d] - dst.offsets[d]) * ds[d] for d in range(n))
    s_off = np.zeros(1, dtype=np.int64) + s0
    d_off = np.zeros(1, dtype=np.int64) + d0
    for d in range(k):  # the outer dimensions: one run per index combination (row-major)
        steps = np.arange(overlap.lengths[d], dtype=np.int64)
        s_off = (s_off[:, None] + steps[None, :] * ss[d]).reshape(-1)
        d_off = (d_off[:, None] + steps[None, :] * ds[d]).reshape(-1)
    out = np.empty((s_off.size, 3), dtype=np.int64)
    out[:, 0] = s_off * itemsize
    out[:, 1] = d_off * itemsize
    out[:, 2] = run * itemsize
    return out
