"""How the ranks of one save agree: version number, blob reports, commit outcome.

A save is a three-step protocol run by every rank's background loop:

1. ``agree_version``: rank 0 claims the next version number in the store; all ranks use it.
2. ``gather_parts``: every rank writes its own blobs durably, then reports a :class:`RankPart`
   (keys, sizes, hashes — or the error it hit); rank 0 receives all of them.
3. ``broadcast_outcome``: rank 0 commits the manifest only if every part is good, then tells
   every rank whether the version committed (or which rank failed and why).

:class:`LocalCoordinator` is the single-process case. The torch.distributed implementation lives
in :mod:`mithril_async.distributed`; it runs these steps over a separate gloo group, with
timeouts, so checkpoint traffic never blocks the training collectives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from pydantic import BaseModel, Field

from mithril_async.manifest import BlobRef, LossyEntry, ShardRef


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
        """Send ``part`` to rank 0; rank 0 returns all parts in rank order, others None."""

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        """Rank 0 passes its outcome; every rank returns it."""

    def close(self) -> None:
        """Release the coordination group."""


class LocalCoordinator:
    """One process, one rank: every step is local."""

    rank = 0
    world_size = 1

    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        return await claim()

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        return [part]

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        assert outcome is not None
        return outcome

    def close(self) -> None:
        return None
