"""Where each rank's piece of a tensor chunked over a device mesh lies, and which pieces
overlap a box: the arithmetic behind the manifest's compact piece layouts.

A DTensor with ``Shard`` / ``Replicate`` placements on a mesh of shape ``mesh`` is described
by ``dims``: per mesh dimension, the tensor dimension it chunks (``Shard(d)``) or None
(``Replicate``). A rank at mesh coordinate ``coord`` holds one box of the global tensor,
computed as torch does (``_compute_local_shape_and_global_offset``): mesh dimensions are
applied left to right, each one cutting the rank's current extent of its tensor dimension
into ``mesh[i]`` chunks by the ``torch.chunk`` rule (chunks of ``ceil(size / parts)``, the last
ones shorter or empty); a tensor dimension cut by several mesh dimensions is cut again inside
the previous chunk. An empty piece sits at offset ``global_shape[d]``, as torch puts it.

So a whole job's pieces of a tensor are given by ``(global_shape, mesh, dims)`` plus each
rank's coordinate: the manifest stores that instead of one box per rank per tensor, and a
restore finds the pieces overlapping the box it needs (:func:`overlapping`) without looking at
every saved rank. Pure integer arithmetic: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["chunk", "mesh_box", "overlapping", "replicated"]

#: per mesh dimension: the tensor dimension it chunks, or None (replicated over it)
Dims = Sequence[int | None]


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``parts`` of an extent of ``size`` (the
    ``torch.chunk`` rule torch's ``Shard`` placement uses; a chunk past the end is empty)."""
    full = -(-size // parts) if parts else 0
    start = min(size, full * index)
    return start, max(0, min(size, start + full) - start)


def mesh_box(global_shape: Sequence[int], mesh: Sequence[int], dims: Dims,
             coord: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, lengths)`` of the piece the rank at ``coord`` holds (module docstring)."""
    offsets = [0] * len(global_shape)
    lengths = list(global_shape)
    empty = [False] * len(global_shape)
    for i, d in enumerate(dims):
        if d is None:
            continue
        start, length = chunk(lengths[d], mesh[i], coord[i])
        offsets[d] += start
        lengths[d] = length
        empty[d] = empty[d] or length == 0
    for d, gone in enumerate(empty):
        if gone:
            offsets[d] = global_shape[d]
    return tuple(offsets), tuple(lengths)


def replicated(mesh: Sequence[int], dims: Dims) -> bool:
    """Whether other ranks hold the same piece (a replicated mesh dimension of size > 1)."""
    return any(d is None and n > 1 for d, n in zip(dims, mesh, strict=True))


def overlapping(global_shape: Sequence[int], mesh: Sequence[int], dims: Dims,
                offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[dict[int, int]]:
    """Every non-empty piece overlapping the box ``[offsets, offsets + lengths)``, as the
    coordinates of the mesh dimensions that chunk the tensor (``{mesh dim: coordinate}``;
    the replicated mesh dimensions are free: every coordinate there holds the same piece).

    Output-sensitive: a few integer divisions per overlapping piece, whatever the mesh size.
    An empty box overlaps nothing."""
    if any(n <= 0 for n in lengths):
        return
    per_dim: list[list[dict[int, int]]] = []
    for d, size in enumerate(global_shape):
        cuts = [i for i, sd in enumerate(dims) if sd == d]
        lo, hi = offsets[d], offsets[d] + lengths[d]
        found = list(_along(cuts, mesh, 0, size, lo, hi, {}))
        if not found:
            return
        per_dim.append(found)
    yield from _product(per_dim, 0, {})


def _along(cuts: Sequence[int], mesh: Sequence[int], start: int, size: int, lo: int,
           hi: int, chosen: dict[int, int]) -> Iterator[dict[int, int]]:
    """The coordinates of the mesh dimensions ``cuts`` (applied in order to the extent
    ``[start, start + size)`` of one tensor dimension) whose chunk overlaps ``[lo, hi)``."""
    if not cuts:
        yield dict(chosen)
        return
    i, rest = cuts[0], cuts[1:]
    parts = mesh[i]
    full = -(-size // parts)
    if full == 0:
        return
    first = max(0, (lo - start) // full)
    last = min(parts - 1, (hi - 1 - start) // full)
    for c in range(first, last + 1):
        c_start, c_len = chunk(size, parts, c)
        if c_len == 0:
            break
        chosen[i] = c
        yield from _along(rest, mesh, start + c_start, c_len, lo, hi, chosen)
    chosen.pop(i, None)


def _product(per_dim: list[list[dict[int, int]]], k: int, acc: dict[int, int]
             ) -> Iterator[dict[int, int]]:
    if k == len(per_dim):
        yield dict(acc)
        return
    for part in per_dim[k]:
        yield from _product(per_dim, k + 1, {**acc, **part})
