"""Pydantic models of the on-disk metadata: version manifests, aliases, the run manifest.

Schemas: runs/<run_id>/versions/vNNNNNN/manifest.json, aliases/{latest,best}.json, run.json
(docs/LAYOUT.md). Every ``key`` is repo-root relative and validated with ``check_key``; parsing
any of these files goes through :func:`parse_model`, which turns malformed JSON, schema
violations and unknown schema versions into typed errors naming the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mithril_async.errors import InvalidFormat, UnknownFormatVersion
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
    #: "<item>/<tensor>" -> its NaN / Inf counts, for each floating tensor of the blob that
    #: holds any (the non-finite guard); written only when there is one
    nonfinite: dict[str, NonFinite] = Field(default_factory=dict, exclude_if=_falsy)


class ShardRef(BlobRef):
    rank: int = Field(ge=0, le=1 << 20)


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
    model: BlobRef
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
    #: a tensor holds NaN/Inf that ``nonfinite_allow`` does not allow (``nonfinite =
    #: "hold"``): the version is committed, but ``latest`` and ``best`` (and the tiers'
    #: ``latest_*``) never point at it; the blobs' ``nonfinite`` say which tensors. Written
    #: only when true
    held: bool = Field(False, exclude_if=_falsy)

    def blobs(self) -> list[BlobRef]:
        """Every blob this version names (model, optimizer shards, extras, lossy shards)."""
        out: list[BlobRef] = [self.model]
        if self.optimizer is not None:
            out.extend(self.optimizer.shards)
        for shards in self.extra.values():
            out.extend(shards)
        if self.lossy is not None:
            out.extend(self.lossy.shards)
        return out

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
    model_key: str
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


def parse_model(cls: type[M], data: bytes, where: str) -> M:
    """Parse JSON ``data`` into ``cls``; typed errors name ``where`` (a key or path)."""
    if len(data) > MAX_METADATA_BYTES:
        raise InvalidFormat(f"{where}: metadata file of {len(data)} bytes is implausibly large")
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
    return model.model_dump_json(indent=2).encode("utf-8") + b"\n"


def version_id(number: int) -> str:
    return f"v{number:06d}"


def version_number(vid: str) -> int:
    if not _VERSION_ID.match(vid):
        raise InvalidFormat(f"not a version id: {vid!r}")
    return int(vid[1:])
