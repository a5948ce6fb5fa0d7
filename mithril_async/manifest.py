"""Pydantic models of the on-disk metadata: version manifests, aliases, the run manifest.

Schemas: runs/<run_id>/versions/vNNNNNN/manifest.json, aliases/{latest,best}.json, run.json
(docs/LAYOUT.md). Every ``key`` is repo-root relative and validated with ``check_key``; parsing
any of these files goes through :func:`parse_model`, which turns malformed JSON, schema
violations and unknown schema versions into typed errors naming the file.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import xxhash
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from mithril_async.errors import InvalidFormat, UnknownFormatVersion
from mithril_async.mesh_layout import mesh_box, replicated
from mithril_async.storage.base import check_key

SCHEMA_VERSION = 1
LAYOUT_VERSION = 1
#: the largest metadata file we will parse (a manifest is a few KiB; refuse hostile sizes)
MAX_METADATA_BYTES = 64 * 1024 * 1024

_VERSION_ID = re.compile(r"^v\d{6,}$")


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Keyed(_Model):
    key: str

    @field_validator("key")
    @classmethod
    def _safe_key(cls, v: str) -> str:
        return check_key(v)


class BaseRef(_Model):
    """The blob a delta-encoded blob was encoded against."""

    version_id: str
    key: str
    xxh64: str

    @field_validator("key")
    @classmethod
    def _safe_key(cls, v: str) -> str:
        return check_key(v)


def _falsy(v: Any) -> bool:
    return not v


def _none(v: Any) -> bool:
    return v is None


class MeshSplit(_Model):
    """How a DTensor's piece arises from its device mesh (:mod:`~mithril_async.mesh_layout`):
    the mesh's shape, per mesh dimension the tensor dimension it chunks (None: replicated
    over it), and the saving rank's coordinate. Never written per piece: ranks whose pieces
    all say how they arise share one :class:`PieceLayout` in the manifest instead."""

    mesh: list[int] = Field(min_length=1, max_length=16)
    dims: list[int | None] = Field(max_length=16)
    coord: list[int] = Field(max_length=16)


class PieceMeta(_Model):
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
    replicated: bool = Field(False, exclude_if=_falsy)
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


class TensorSplit(_Model):
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


class PieceLayout(_Model):
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


class NonFinite(_Model):
    """The NaN and Inf elements of one stored tensor (or of this rank's piece of it),
    counted on its values as the save saw them: never their XOR delta, never after lossy
    quantisation (``[checkpointing] nonfinite``)."""

    nan: int = Field(0, ge=0, le=1 << 62)
    inf: int = Field(0, ge=0, le=1 << 62)
    #: the tensor matches ``nonfinite_allow``: its values do not hold the version
    allowed: bool = Field(False, exclude_if=_falsy)


def merge_nonfinite(counts: Iterable[Mapping[str, NonFinite]]) -> dict[str, NonFinite]:
    """Counts of the same tensor in several blobs (its pieces on several ranks) summed."""
    out: dict[str, NonFinite] = {}
    for blob in counts:
        for name, c in blob.items():
            had = out.get(name)
            out[name] = c if had is None else NonFinite(
                nan=had.nan + c.nan, inf=had.inf + c.inf, allowed=had.allowed and c.allowed)
    return out


class BlobRef(_Keyed):
    """One stored artifact: where it is, how big, its checksum and how it was made."""

    bytes: int = Field(ge=0, le=1 << 50)
    xxh64: str = Field(pattern=r"^[0-9a-f]{16}$")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    format: Literal["mckp", "safetensors", "json", "toml", "mldc"] = "mckp"
    raw_bytes: int = Field(default=0, ge=0, le=1 << 50)
    #: the blob this one is XOR-delta encoded against (None for a keyframe)
    base: BaseRef | None = None
    #: blobs holding full copies of tensors this blob only references (unchanged tensors)
    refs: list[BaseRef] = Field(default_factory=list)
    #: tensor name -> where it sits in its global tensor, for sharded state;
    #: written only when there is some, so other manifests are what they were
    pieces: dict[str, PieceMeta] = Field(default_factory=dict, exclude_if=_falsy)
    #: instead of ``pieces``: the manifest's :class:`PieceLayout` (its ``layouts`` key) the
    #: tensors follow, and the saving rank's coordinate on its mesh
    layout: str | None = Field(None, pattern=r"^[0-9a-f]{16}$", exclude_if=_none)
    coord: list[int] = Field(default_factory=list, max_length=16, exclude_if=_falsy)
    #: "<item>/<tensor>" -> its NaN / Inf counts, for each floating tensor of the blob that
    #: holds any (the non-finite guard); written only when there is one
    nonfinite: dict[str, NonFinite] = Field(default_factory=dict, exclude_if=_falsy)
    _layout: PieceLayout | None = PrivateAttr(None)

    @property
    def has_pieces(self) -> bool:
        """Whether the blob records where its tensors sit (explicitly or by a layout)."""
        return bool(self.pieces) or self.layout is not None

    def bind(self, layout: PieceLayout) -> None:
        """Attach the layout this ref names (done when a manifest is validated)."""
        self._layout = layout

    def bound_layout(self) -> PieceLayout:
        """The piece layout this ref names, as attached by its manifest."""
        if self._layout is None:
            raise InvalidFormat(f"{self.key}: names piece layout {self.layout} but none is "
                                "attached (read it through its VersionManifest)")
        return self._layout

    def piece_names(self) -> frozenset[str]:
        """The tensors whose pieces the blob records."""
        return self.bound_layout().names() if self.layout is not None else frozenset(self.pieces)

    def piece(self, name: str) -> PieceMeta | None:
        """Where tensor ``name`` of this blob sits in its global tensor (None: not recorded)."""
        if self.layout is None:
            return self.pieces.get(name)
        layout = self.bound_layout()
        return layout.piece(name, self.coord) if name in layout.tensors else None

    def piece_table(self) -> dict[str, PieceMeta]:
        """Every recorded piece by tensor name (computed from the layout, if it has one)."""
        if self.layout is None:
            return dict(self.pieces)
        layout = self.bound_layout()
        return {name: layout.piece(name, self.coord) for name in layout.tensors}

    def with_pieces(self) -> BlobRef:
        """This ref with its pieces spelled out (for code that reads ``pieces``)."""
        if self.layout is None:
            return self
        return self.model_copy(update={"pieces": self.piece_table(), "layout": None,
                                       "coord": []})


class ShardRef(BlobRef):
    rank: int = Field(ge=0, le=1 << 20)

    def with_pieces(self) -> ShardRef:
        out = super().with_pieces()
        assert isinstance(out, ShardRef)
        return out


class RankKey(_Keyed):
    rank: int = Field(ge=0, le=1 << 20)
    #: xxh64 of the file (RNG + data-loader state); absent in manifests of older writers
    xxh64: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")


class Paths(_Model):
    layout_version: int = LAYOUT_VERSION
    root_local: str | None = None
    root_remote: str | None = None


class OptimizerEntry(_Model):
    sharding: Literal["none", "per_rank"] = "per_rank"
    shards: list[ShardRef] = Field(default_factory=list)


class RngEntry(_Model):
    per_rank: bool = True
    keys: list[RankKey] = Field(default_factory=list)


class ResumeInfo(_Model):
    base_step: int
    exact: bool


class SaveStats(_Model):
    stall_s: float = 0.0
    total_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0


class LossyEntry(_Model):
    """How a version's lossy part was made (``[checkpointing.lossy]``), and where it is.

    One MLDC blob per rank (docs/FORMAT.md). A delta's ``base`` names the previous version's
    lossy blob: restoring it decodes the chain from its keyframe, and retention keeps that
    chain because bases are dependencies."""

    codec: Literal["excp_delta"] = "excp_delta"
    version: int = 1
    #: this version starts a chain (no base)
    keyframe: bool
    #: position in the chain (0 = the keyframe)
    index: int = Field(ge=0)
    #: the LossyDeltaConfig the blob was encoded with (density, bits, keyframe mode, bounds...)
    params: dict[str, Any] = Field(default_factory=dict)
    #: "<item>/<tensor>" names held in the lossy blob (all others are in the lossless blobs)
    tensors: list[str] = Field(default_factory=list)
    #: names whose stored values are quantised in this version (empty for a lossless keyframe)
    quantized: list[str] = Field(default_factory=list)
    shards: list[ShardRef] = Field(default_factory=list)


class VersionManifest(_Model):
    """``versions/vNNNNNN/manifest.json``: everything needed to restore one version."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    version_id: str = Field(pattern=_VERSION_ID.pattern)
    created_at: datetime
    step: int = Field(ge=0)
    world_size: int = Field(default=1, ge=1, le=1 << 20)
    paths: Paths = Field(default_factory=Paths)
    config: BlobRef | None = None
    #: the ``model`` item (rank 0's whole model, or rank 0's shard of a sharded one); None:
    #: the state had no ``model`` entry (every item is then in ``optimizer`` / ``extra``)
    model: BlobRef | None = Field(None, exclude_if=_falsy)
    optimizer: OptimizerEntry | None = None
    rng: RngEntry = Field(default_factory=RngEntry)
    extra: dict[str, list[ShardRef]] = Field(default_factory=dict)
    resume: ResumeInfo
    metrics: dict[str, Any] = Field(default_factory=dict)
    compression: dict[str, Any] = Field(default_factory=dict)
    stats: SaveStats = Field(default_factory=SaveStats)
    #: some stored tensor of this version is quantised (lossy tier, always opt-in); written
    #: only when true, so lossless manifests are what they were before the lossy tier
    has_quantization: bool = Field(False, exclude_if=_falsy)
    lossy: LossyEntry | None = Field(None, exclude_if=_falsy)
    #: the piece layouts the blobs' ``layout`` fields name, by content hash
    layouts: dict[str, PieceLayout] = Field(default_factory=dict, exclude_if=_falsy)
    #: a tensor holds NaN/Inf that ``nonfinite_allow`` does not allow (``nonfinite =
    #: "hold"``): the version is committed, but ``latest`` and ``best`` (and the tiers'
    #: ``latest_*``) never point at it; the blobs' ``nonfinite`` say which tensors. Written
    #: only when true
    held: bool = Field(False, exclude_if=_falsy)

    @model_validator(mode="after")
    def _bind_layouts(self) -> VersionManifest:
        """Every blob naming a layout gets it attached; one naming a layout the manifest
        lacks, a coordinate outside its mesh, or both a layout and explicit pieces, is
        refused."""
        for ref in self._piece_refs():
            if ref.layout is None:
                continue
            layout = self.layouts.get(ref.layout)
            if layout is None:
                raise ValueError(f"{ref.key} names piece layout {ref.layout}, which the "
                                 "manifest does not hold")
            if ref.pieces:
                raise ValueError(f"{ref.key} has both pieces and a piece layout")
            if len(ref.coord) != len(layout.mesh) or any(
                    not 0 <= c < n for c, n in zip(ref.coord, layout.mesh, strict=True)):
                raise ValueError(f"{ref.key}: coordinate {ref.coord} is not on the "
                                 f"{layout.mesh} mesh of its piece layout")
            ref.bind(layout)
        return self

    def _piece_refs(self) -> Iterable[BlobRef]:
        if self.model is not None:
            yield self.model
        if self.optimizer is not None:
            yield from self.optimizer.shards
        for shards in self.extra.values():
            yield from shards

    def blobs(self) -> list[BlobRef]:
        """Every blob this version names (model, optimizer shards, extras, lossy shards)."""
        out: list[BlobRef] = [] if self.model is None else [self.model]
        if self.optimizer is not None:
            out.extend(self.optimizer.shards)
        for shards in self.extra.values():
            out.extend(shards)
        if self.lossy is not None:
            out.extend(self.lossy.shards)
        return out

    def item_names(self) -> list[str]:
        """The state items this version holds, in the manifest's order."""
        names = ([] if self.model is None else ["model"]) + (
            ["optimizer"] if self.optimizer is not None else []) + list(self.extra)
        return list(dict.fromkeys(names))

    def all_keys(self) -> list[str]:
        return [b.key for b in self.blobs()] + [r.key for r in self.rng.keys]

    def nonfinite_tensors(self) -> dict[str, NonFinite]:
        """Every tensor of this version holding NaN or Inf, "<item>/<tensor>" -> its counts
        summed over the blobs holding a piece of it (one per rank for sharded state)."""
        return merge_nonfinite(b.nonfinite for b in self.blobs())


class AliasFile(_Model):
    """``aliases/<name>.json``: a pointer to a version; ``best`` is ``pending`` until a metric."""

    schema_version: int = SCHEMA_VERSION
    name: str
    status: Literal["ok", "pending"]
    run_id: str
    version_id: str | None = None
    step: int | None = None
    manifest_key: str | None = None
    metric_name: str | None = None
    metric_value: float | None = None
    mode: Literal["min", "max"] | None = None
    updated_at: datetime

    @field_validator("manifest_key")
    @classmethod
    def _safe_key(cls, v: str | None) -> str | None:
        return None if v is None else check_key(v)


class VersionSummary(_Model):
    version_id: str
    step: int
    created_at: datetime
    model_key: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    bytes: int = 0
    #: the version is held (its manifest's ``held``): no alias points at it
    held: bool = Field(False, exclude_if=_falsy)


class RunManifest(_Model):
    """``runs/<run_id>/run.json``: the run's versions and aliases at a glance."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    created_at: datetime
    paths: Paths = Field(default_factory=Paths)
    config: BlobRef | None = None
    aliases: dict[str, str | None] = Field(default_factory=dict)
    versions: list[VersionSummary] = Field(default_factory=list)


M = TypeVar("M", bound=BaseModel)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while metadata is parsed or built.

    A manifest of thousands of ranks is tens of thousands of small models: allocating them
    triggers a collection every few hundred objects, each scanning everything alive, which
    doubles the time of a parse. None of them forms a cycle, so nothing is lost by
    collecting once afterwards instead (whatever was enabled before is enabled again)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def parse_model(cls: type[M], data: bytes, where: str) -> M:
    """Parse JSON ``data`` into ``cls``; typed errors name ``where`` (a key or path)."""
    if len(data) > MAX_METADATA_BYTES:
        raise InvalidFormat(f"{where}: metadata file of {len(data)} bytes is implausibly large")
    with gc_paused():
        return _parse(cls, data, where)


def _parse(cls: type[M], data: bytes, where: str) -> M:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidFormat(f"{where}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise InvalidFormat(f"{where}: expected a JSON object, got {type(raw).__name__}")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UnknownFormatVersion(
            f"{where}: schema_version {version!r} is not one this reader knows ({SCHEMA_VERSION})"
        )
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:5]
        )
        raise InvalidFormat(f"{where}: does not match the {cls.__name__} schema: {problems}"
                            ) from None


def dump_model(model: BaseModel) -> bytes:
    """Serialise a model as pretty JSON (stable key order, UTF-8)."""
    with gc_paused():
        return model.model_dump_json(indent=2).encode("utf-8") + b"\n"


def version_id(number: int) -> str:
    return f"v{number:06d}"


def version_number(vid: str) -> int:
    if not _VERSION_ID.match(vid):
        raise InvalidFormat(f"not a version id: {vid!r}")
    return int(vid[1:])
