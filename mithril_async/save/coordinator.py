"""How the ranks of one save agree: version number, blob reports, commit outcome.

A save is a three-step protocol run by every rank's background loop:

1. ``agree_version``: rank 0 claims the next version number in the store; all ranks use it.
2. ``gather_parts``: every rank writes its own blobs durably, then reports a :class:`RankPart`
   (keys, sizes, hashes — or the error it hit); rank 0 receives all of them. A part travels
   compact (:func:`compact_part`): a shard's pieces become a piece layout shared by every
   rank with the same tensors on the same mesh plus the rank's coordinate, and each distinct
   layout reaches rank 0 once (:func:`layout_senders`), so what rank 0 receives and commits
   grows by a few entries per rank, not by one per rank per tensor.
3. ``broadcast_outcome``: rank 0 commits the manifest only if every part is good, then tells
   every rank whether the version committed (or which rank failed and why).

:class:`LocalCoordinator` is the single-process case. The torch.distributed implementation lives
in :mod:`mithril_async.distributed`; it runs these steps over a separate gloo group, with
timeouts, so checkpoint traffic never blocks the training collectives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from mithril_async.errors import DistributedError
from mithril_async.manifest import BlobRef, LossyEntry, PieceLayout, ShardRef, compact_pieces


class RankPart(BaseModel):
    """What one rank wrote for a version (or why it could not)."""

    rank: int
    model: BlobRef | None = None
    shards: dict[str, ShardRef] = Field(default_factory=dict)
    #: this rank's lossy blob and how it was made ([checkpointing.lossy] only)
    lossy: LossyEntry | None = None
    rng_key: str | None = None
    rng_xxh64: str | None = None
    #: the RNG file's size, checked before the commit like every blob's
    rng_bytes: int | None = None
    exact: bool = True
    bytes_in: int = 0
    bytes_out: int = 0
    error: str | None = None
    #: the piece layouts this part's shards name, by id (see :func:`compact_part`)
    layouts: dict[str, PieceLayout] = Field(default_factory=dict)

    def layout_ids(self) -> set[str]:
        """The piece layouts this part's shards name."""
        return {ref.layout for ref in self.shards.values() if ref.layout is not None}


def compact_part(part: RankPart) -> RankPart:
    """``part`` with each shard's pieces stored as a piece layout (in ``part.layouts``) and
    this rank's coordinate, where the pieces say how they arise from a device mesh
    (:func:`~mithril_async.manifest.compact_pieces`); other shards keep their pieces. A
    part already compact is returned as it is."""
    shards: dict[str, ShardRef] = {}
    layouts = dict(part.layouts)
    changed = False
    for name, ref in part.shards.items():
        got = compact_pieces(ref.pieces) if ref.pieces else None
        if got is None:
            shards[name] = ref
            continue
        layout, coord = got
        lid = layout.layout_id()
        layouts.setdefault(lid, layout)
        shards[name] = ref.model_copy(update={"pieces": {}, "layout": lid, "coord": coord})
        changed = True
    if not changed:
        return part
    return part.model_copy(update={"shards": shards, "layouts": layouts})


def layout_senders(parts: Iterable[RankPart]) -> dict[str, int]:
    """For each piece layout the (compact, layout-less) ``parts`` name, the lowest rank
    naming it: the one rank that sends it to rank 0."""
    out: dict[str, int] = {}
    for p in parts:
        for lid in p.layout_ids():
            if lid not in out or p.rank < out[lid]:
                out[lid] = p.rank
    return out


def with_layouts(parts: list[RankPart], layouts: Mapping[str, PieceLayout]) -> list[RankPart]:
    """``parts`` (received without their layouts, so rank 0's own copies) each given the
    layouts it names, in place; a layout no rank sent is a :class:`DistributedError`."""
    for p in parts:
        ids = p.layout_ids()
        missing = sorted(ids - layouts.keys())
        if missing:
            raise DistributedError(f"rank {p.rank}'s part names piece layout(s) "
                                   f"{', '.join(missing)} that no rank sent")
        p.layouts = {lid: layouts[lid] for lid in ids}
    return parts


class Outcome(BaseModel):
    """Rank 0's verdict on a version, broadcast to every rank."""

    committed: bool
    manifest_key: str | None = None
    error: str | None = None
    failed_rank: int | None = None
    #: the version's claim is no longer rank 0's: no rank may delete what is in its folder
    claim_lost: bool = False
    #: tensors of the version (every rank's) holding NaN/Inf that ``nonfinite_allow`` does
    #: not allow, "<item>/<tensor>" -> (NaNs, Infs); on a version not committed, they are
    #: why (``nonfinite = "fail"``)
    nonfinite: dict[str, tuple[int, int]] = Field(default_factory=dict)
    #: committed but held (``nonfinite = "hold"``): no alias moved to it
    held: bool = False


class Coordinator(Protocol):
    rank: int
    world_size: int

    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        """Rank 0 calls ``claim()``; every rank returns the same version number."""

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        """Send ``part`` to rank 0; rank 0 returns all parts in rank order (compact, each
        holding the piece layouts it names), others None."""

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        """Rank 0 passes its outcome; every rank returns it."""

    def close(self) -> None:
        """Release the coordination group."""


@runtime_checkable
class GroupBacked(Protocol):
    """A coordinator whose collectives run over a ``torch.distributed`` process group:
    other agreements among the same ranks (the signal-driven save step) form their own
    group of its ranks, with its timeout. ``group`` None: the default world group."""

    @property
    def group(self) -> Any: ...

    @property
    def timeout_s(self) -> float: ...


@runtime_checkable
class Wrapping(Protocol):
    """A layer's coordinator around another one (the tier commit's,
    :class:`~mithril_async.tiers.commit.TierCoordinator`), whose collectives it runs on."""

    inner: Coordinator


def innermost(coordinator: Coordinator) -> Coordinator:
    """The coordinator whose collectives ``coordinator`` runs on: itself, or the one the
    layers wrapped around it keep as ``inner``."""
    while isinstance(coordinator, Wrapping):
        coordinator = coordinator.inner
    return coordinator


class LocalCoordinator:
    """One process, one rank: every step is local."""

    rank = 0
    world_size = 1

    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        return await claim()

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        return [compact_part(part)]

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        assert outcome is not None
        return outcome

    def close(self) -> None:
        return None
