"""Pydantic models of the on-disk metadata: version manifests, aliases, the run manifest.

Schemas: runs/<run_id>/versions/vNNNNNN/manifest.json, aliases/{latest,best}.json, run.json
(docs/LAYOUT.md). Every ``key`` is repo-root relative and validated with ``check_key``; parsing
any of these files goes through :func:`parse_model`, which turns malformed JSON, schema
violations and unknown schema versions into typed errors naming the file. What every model
shares: :mod:`~mithril_async.manifest_base`; a sharded tensor's piece layouts:
:mod:`~mithril_async.manifest_pieces` (their names import from here too).
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from mithril_async.errors import InvalidFormat, UnknownFormatVersion
from mithril_async.manifest_base import Keyed, Model, falsy, none
from mithril_async.manifest_pieces import (  # noqa: F401  (re-exported: their old home)
    MeshSplit,
    PieceLayout,
    PieceMeta,
    TensorSplit,
    compact_pieces,
)
from mithril_async.storage.base import check_key

SCHEMA_VERSION = 1
LAYOUT_VERSION = 1
#: the largest metadata file we will parse (a manifest is a few KiB; refuse hostile sizes)
MAX_METADATA_BYTES = 64 * 1024 * 1024

_VERSION_ID = re.compile(r"^v\d{6,}$")


def utcnow() -> datetime:
    return datetime.now(UTC)


class BaseRef(Model):
    """The blob a delta-encoded blob was encoded against."""

    version_id: str
    key: str
    xxh64: str

    @field_validator("key")
    @classmethod
    def _safe_key(cls, v: str) -> str:
        return check_key(v)


class NonFinite(Model):
    """The NaN and Inf elements of one stored tensor (or of this rank's piece of it),
    counted on its values as the save saw them: never their XOR delta, never after lossy
    quantisation (``[checkpointing] nonfinite``)."""

    nan: int = Field(0, ge=0, le=1 << 62)
    inf: int = Field(0, ge=0, le=1 << 62)
    #: the tensor matches ``nonfinite_allow``: its values do not hold the version
    allowed: bool = Field(False, exclude_if=falsy)


def merge_nonfinite(counts: Iterable[Mapping[str, NonFinite]]) -> dict[str, NonFinite]:
    """Counts of the same tensor in several blobs (its pieces on several ranks) summed."""
    out: dict[str, NonFinite] = {}
    for blob in counts:
        for name, c in blob.items():
            had = out.get(name)
            out[name] = c if had is None else NonFinite(
                nan=had.nan + c.nan, inf=had.inf + c.inf, allowed=had.allowed and c.allowed)
    return out


class BlobRef(Keyed):
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
    pieces: dict[str, PieceMeta] = Field(default_factory=dict, exclude_if=falsy)
    #: instead of ``pieces``: the manifest's :class:`PieceLayout` (its ``layouts`` key) the
    #: tensors follow, and the saving rank's coordinate on its mesh
    layout: str | None = Field(None, pattern=r"^[0-9a-f]{16}$", exclude_if=none)
    coord: list[int] = Field(default_factory=list, max_length=16, exclude_if=falsy)
    #: "<item>/<tensor>" -> its NaN / Inf counts, for each floating tensor of the blob that
    #: holds any (the non-finite guard); written only when there is one
    nonfinite: dict[str, NonFinite] = Field(default_factory=dict, exclude_if=falsy)
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


class RankKey(Keyed):
    rank: int = Field(ge=0, le=1 << 20)
    #: xxh64 of the file (RNG + data-loader state); absent in manifests of older writers
    xxh64: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")


class Paths(Model):
    layout_version: int = LAYOUT_VERSION
    root_local: str | None = None
    root_remote: str | None = None


class OptimizerEntry(Model):
    sharding: Literal["none", "per_rank"] = "per_rank"
    shards: list[ShardRef] = Field(default_factory=list)


class RngEntry(Model):
    per_rank: bool = True
    keys: list[RankKey] = Field(default_factory=list)


class ResumeInfo(Model):
    base_step: int
    exact: bool


class SaveStats(Model):
    stall_s: float = 0.0
    total_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0


class LossyEntry(Model):
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


class VersionManifest(Model):
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
    model: BlobRef | None = Field(None, exclude_if=falsy)
    optimizer: OptimizerEntry | None = None
    rng: RngEntry = Field(default_factory=RngEntry)
    extra: dict[str, list[ShardRef]] = Field(default_factory=dict)
    resume: ResumeInfo
    metrics: dict[str, Any] = Field(default_factory=dict)
    compression: dict[str, Any] = Field(default_factory=dict)
    stats: SaveStats = Field(default_factory=SaveStats)
    #: some stored tensor of this version is quantised (lossy tier, always opt-in); written
    #: only when true, so lossless manifests are what they were before the lossy tier
    has_quantization: bool = Field(False, exclude_if=falsy)
    lossy: LossyEntry | None = Field(None, exclude_if=falsy)
    #: the piece layouts the blobs' ``layout`` fields name, by content hash
    layouts: dict[str, PieceLayout] = Field(default_factory=dict, exclude_if=falsy)
    #: a tensor holds NaN/Inf that ``nonfinite_allow`` does not allow (``nonfinite =
    #: "hold"``): the version is committed, but ``latest`` and ``best`` (and the tiers'
    #: ``latest_*``) never point at it; the blobs' ``nonfinite`` say which tensors. Written
    #: only when true
    held: bool = Field(False, exclude_if=falsy)

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


class AliasFile(Model):
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


class VersionSummary(Model):
    version_id: str
    step: int
    created_at: datetime
    model_key: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    bytes: int = 0
    #: the version is held (its manifest's ``held``): no alias points at it
    held: bool = Field(False, exclude_if=falsy)


class RunManifest(Model):
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
