"""The saved pieces of one sharded item, found by box instead of by looking at every rank.

A restore from pieces asks, for each tensor, which saved pieces overlap the box this rank
needs. Looking through every saved rank's piece costs each rank ``saved ranks x tensors``;
at thousands of ranks that would be most of a restore. A :class:`PieceIndex` answers from the
manifest's piece layouts instead (:class:`~mithril_async.manifest.PieceLayout`): the pieces
overlapping a box are computed from the mesh arithmetic
(:func:`~mithril_async.mesh_layout.overlapping`), and each is mapped to the lowest saved rank
at that mesh coordinate through a table built once per layout. Blobs that recorded their
pieces one by one (pieces no mesh explains, or manifests without piece layouts) are looked
through one by one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mithril_async.manifest import PieceLayout, ShardRef
from mithril_async.mesh_layout import mesh_box, overlapping, replicated
from mithril_async.restore.reshard import Box, SavedPiece

__all__ = ["PieceIndex"]


@dataclass
class _LayoutRanks:
    """The saved ranks following one piece layout, by mesh coordinate."""

    layout: PieceLayout
    #: the lowest rank at each coordinate
    by_coord: dict[tuple[int, ...], int]
    #: the lowest rank of the layout (it holds every piece that every rank holds)
    first: int
    #: per set of mesh dimensions that chunk a tensor: the lowest rank at each coordinate
    #: of those dimensions (the others replicate the piece)
    lowest: dict[tuple[int, ...], dict[tuple[int, ...], int]] = field(default_factory=dict)

    @classmethod
    def of(cls, layout: PieceLayout, ranks: Sequence[tuple[int, ShardRef]]) -> _LayoutRanks:
        """``ranks``: (rank, ref) of every blob following ``layout``, lowest rank first."""
        by_coord = {tuple(ref.coord): rank for rank, ref in reversed(ranks)}  # lowest wins
        return cls(layout, by_coord, ranks[0][0])

    def lowest_at(self, cut: tuple[int, ...], at: tuple[int, ...]) -> int | None:
        table = self.lowest.get(cut)
        if table is None:
            if len(cut) == len(self.layout.mesh):  # no replicated mesh dimension
                table = self.by_coord
            else:
                table = {}
                for coord, rank in self.by_coord.items():
                    k = tuple(coord[i] for i in cut)
                    if k not in table or rank < table[k]:
                        table[k] = rank
            self.lowest[cut] = table
        return table.get(at)

    def pieces(self, name: str, need: Box, refs: Mapping[int, ShardRef]) -> list[SavedPiece]:
        t = self.layout.tensors.get(name)
        if t is None:
            return []
        shape, mesh = t.global_shape, self.layout.mesh
        if t.dims is None:  # held whole by every rank of the layout
            whole = Box(tuple(0 for _ in shape), tuple(shape))
            return [SavedPiece(self.first, whole, True)] if whole.intersect(need) else []
        cut = tuple(i for i, d in enumerate(t.dims) if d is not None)
        rep = replicated(mesh, t.dims)
        out = []
        for sel in overlapping(shape, mesh, t.dims, need.offsets, need.lengths):
            rank = self.lowest_at(cut, tuple(sel[i] for i in cut))
            if rank is None:  # no saved rank holds it: the coverage check names the hole
                continue
            offsets, lengths = mesh_box(shape, mesh, t.dims, refs[rank].coord)
            out.append(SavedPiece(rank, Box(offsets, lengths), rep))
        return out


class PieceIndex:
    """The saved pieces of one sharded item (``refs``: its blob per saved rank)."""

    def __init__(self, refs: Mapping[int, ShardRef]) -> None:
        self.refs = refs
        #: ranks whose blobs list their pieces one by one
        self._listed: list[int] = []
        groups: dict[str, list[tuple[int, ShardRef]]] = {}
        for rank in sorted(refs):
            ref = refs[rank]
            if ref.layout is not None:
                groups.setdefault(ref.layout, []).append((rank, ref))
            elif ref.pieces:
                self._listed.append(rank)
        self._layouts = {lid: _LayoutRanks.of(ranks[0][1].bound_layout(), ranks)
                         for lid, ranks in groups.items()}

    def shape_mismatch(self, name: str, global_shape: Sequence[int]
                       ) -> tuple[int, list[int]] | None:
        """A saved rank and the global shape it recorded for ``name``, if that differs from
        ``global_shape`` (the lowest such rank of each layout, every listing rank)."""
        want = list(global_shape)
        for group in self._layouts.values():
            t = group.layout.tensors.get(name)
            if t is not None and t.global_shape != want:
                return group.first, t.global_shape
        for rank in self._listed:
            p = self.refs[rank].pieces.get(name)
            if p is not None and p.global_shape != want:
                return rank, p.global_shape
        return None

    def overlapping(self, name: str, need: Box) -> list[SavedPiece]:
        """The saved pieces of tensor ``name`` that overlap ``need`` (replicas included as
        the lowest rank holding them; :func:`~mithril_async.restore.reshard.plan_reads`
        checks that they tile it)."""
        out: list[SavedPiece] = []
        for group in self._layouts.values():
            out += group.pieces(name, need, self.refs)
        for rank in self._listed:
            p = self.refs[rank].pieces.get(name)
            if p is None:
                continue
            box = Box.of(p.offsets, p.lengths)
            if len(box.offsets) != len(need.offsets) or box.intersect(need) is not None:
                out.append(SavedPiece(rank, box, p.replicated))
        return out
