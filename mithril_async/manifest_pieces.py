"""The piece layout of a sharded tensor, as the manifest records it.

A rank of a sharded model saves the pieces of each tensor it holds (``ShardedModel`` /
``ShardedOptimizer``): where each lies in the global tensor (:class:`PieceMeta`). Every rank
of a mesh-sharded state holds the same kind of split, so the manifest records one
:class:`PieceLayout` per layout (``VersionManifest.layouts``, by content hash) and each blob
only its mesh coordinate (:func:`compact_pieces`); a restore on any world size reads the
pieces overlapping its own shards from either form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import xxhash
from pydantic import Field, PrivateAttr, field_validator, model_validator

from mithril_async.manifest_base import Model, falsy
from mithril_async.mesh_layout import mesh_box, replicated


class MeshSplit(Model):
    """How a DTensor's piece arises from its device mesh (:mod:`~mithril_async.mesh_layout`):
    the mesh's shape, per mesh dimension the tensor dimension it chunks (None: replicated
    over it), and the saving rank's coordinate. Never written per piece: ranks whose pieces
    all say how they arise share one :class:`PieceLayout` in the manifest instead."""

    mesh: list[int] = Field(min_length=1, max_length=16)
    dims: list[int | None] = Field(max_length=16)
    coord: list[int] = Field(max_length=16)


class PieceMeta(Model):
    """Where one stored tensor sits inside its global tensor (DCP's "chunk metadata").

    Recorded for the tensors of sharded state (DTensors of ``ShardedModel`` /
    ``ShardedOptimizer``: FSDP2, tensor parallel) so a restore on another world size or mesh
    can compute which stored pieces overlap the piece it needs. The piece is the box
    ``[offsets[d], offsets[d] + lengths[d])`` of every dimension ``d`` of ``global_shape``;
    ``replicated``: other ranks hold the same box (a ``Replicate`` mesh dimension, or a plain
    tensor such as an optimizer's step counter), so a restore reads one copy, the lowest
    rank's. Absent in older manifests (and for unsharded state).
    """

    global_shape: list[int] = Field(max_length=64)
    offsets: list[int] = Field(max_length=64)
    lengths: list[int] = Field(max_length=64)
    dtype: str = Field(max_length=32)
    replicated: bool = Field(False, exclude_if=falsy)
    #: how the box arises from a device mesh, when the saving rank knows it (never stored)
    split: MeshSplit | None = Field(None, exclude=True)

    @field_validator("global_shape", "offsets", "lengths")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(x < 0 for x in v):
            raise ValueError("negative size or offset")
        return v

    @model_validator(mode="after")
    def _inside(self) -> PieceMeta:
        n = len(self.global_shape)
        if len(self.offsets) != n or len(self.lengths) != n:
            raise ValueError(f"piece of a {n}-d tensor with {len(self.offsets)} offsets and "
                             f"{len(self.lengths)} lengths")
        for d, (o, ln, g) in enumerate(zip(self.offsets, self.lengths, self.global_shape,
                                           strict=True)):
            if o + ln > g:
                raise ValueError(f"dimension {d}: piece [{o}, {o + ln}) exceeds the global "
                                 f"size {g}")
        return self


class TensorSplit(Model):
    """One tensor of a :class:`PieceLayout`: its global shape and dtype, and per mesh
    dimension the tensor dimension it chunks (None: replicated over it). ``dims`` None: a
    tensor every rank holds whole (a plain tensor such as an optimizer's step counter)."""

    global_shape: list[int] = Field(max_length=64)
    dtype: str = Field(max_length=32)
    dims: list[int | None] | None = Field(None, max_length=16)

    @model_validator(mode="after")
    def _valid(self) -> TensorSplit:
        if any(x < 0 for x in self.global_shape):
            raise ValueError("negative size")
        for d in self.dims or ():
            if d is not None and not 0 <= d < len(self.global_shape):
                raise ValueError(f"mesh dimension chunks tensor dimension {d} of a "
                                 f"{len(self.global_shape)}-d tensor")
        return self


class PieceLayout(Model):
    """The pieces of one item's tensors over one device mesh, for every rank at once: a
    rank whose blob follows this layout holds, of each tensor, the box its mesh coordinate
    gives (:func:`~mithril_async.mesh_layout.mesh_box`). One layout serves every rank with
    the same tensors on the same mesh (all of them, under FSDP2), so a manifest grows by one
    coordinate per rank instead of one box per rank per tensor."""

    mesh: list[int] = Field(min_length=1, max_length=16)
    tensors: dict[str, TensorSplit]
    _names: frozenset[str] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _fits(self) -> PieceLayout:
        if any(n < 1 for n in self.mesh):
            raise ValueError("a mesh dimension of size < 1")
        for name, t in self.tensors.items():
            if t.dims is not None and len(t.dims) != len(self.mesh):
                raise ValueError(f"tensor {name!r}: {len(t.dims)} placements on a "
                                 f"{len(self.mesh)}-d mesh")
        return self

    def names(self) -> frozenset[str]:
        """The tensors this layout describes."""
        if self._names is None:
            self._names = frozenset(self.tensors)
        return self._names

    def piece(self, name: str, coord: Sequence[int]) -> PieceMeta:
        """The piece of tensor ``name`` the rank at ``coord`` holds."""
        t = self.tensors[name]
        # built without validation: the layout was validated and mesh_box stays inside it
        if t.dims is None:
            n = len(t.global_shape)
            return PieceMeta.model_construct(global_shape=t.global_shape, offsets=[0] * n,
                                             lengths=t.global_shape, dtype=t.dtype,
                                             replicated=True)
        offsets, lengths = mesh_box(t.global_shape, self.mesh, t.dims, coord)
        return PieceMeta.model_construct(global_shape=t.global_shape, offsets=list(offsets),
                                         lengths=list(lengths), dtype=t.dtype,
                                         replicated=replicated(self.mesh, t.dims))

    def layout_id(self) -> str:
        """Content hash naming this layout in a manifest (the same on every rank)."""
        canon = json.dumps(self.model_dump(mode="json"), sort_keys=True,
                           separators=(",", ":"))
        return xxhash.xxh64_hexdigest(canon.encode())


def compact_pieces(pieces: Mapping[str, PieceMeta]) -> tuple[PieceLayout, list[int]] | None:
    """``pieces`` (one rank's, of one item) as a layout and this rank's mesh coordinate,
    when every piece says how it arises from one mesh (a plain tensor held whole counts)
    and that reproduces its box exactly; else None (the pieces are stored as they are)."""
    mesh: list[int] | None = None
    coord: list[int] | None = None
    tensors: dict[str, TensorSplit] = {}
    for name, p in pieces.items():
        s = p.split
        if s is None:
            whole = not any(p.offsets) and p.lengths == p.global_shape
            if not (whole and p.replicated):
                return None
            tensors[name] = TensorSplit(global_shape=p.global_shape, dtype=p.dtype)
            continue
        if mesh is None:
            mesh, coord = s.mesh, s.coord
        if s.mesh != mesh or s.coord != coord or len(s.dims) != len(mesh):
            return None
        box = mesh_box(p.global_shape, s.mesh, s.dims, s.coord)
        if box != (tuple(p.offsets), tuple(p.lengths)) \
                or replicated(s.mesh, s.dims) != p.replicated:
            return None
        tensors[name] = TensorSplit(global_shape=p.global_shape, dtype=p.dtype, dims=s.dims)
    if mesh is None or coord is None:
        return None
    return PieceLayout(mesh=mesh, tensors=tensors), coord
