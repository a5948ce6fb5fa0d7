"""Preservation policies: which committed versions to keep.

Each policy is a small class answering "which of these versions do you want kept?"; the
union of all policies' answers is kept, everything else may be deleted — except what an alias
points to and every delta base a kept version depends on (:func:`plan_retention` adds those,
transitively). Retention runs only after a new version has committed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from mithril_async.manifest import VersionManifest


class Policy(Protocol):
    def keep(self, versions: Sequence[VersionManifest]) -> set[str]:
        """Version ids this policy wants kept (``versions`` sorted by step, oldest first)."""


@dataclass(frozen=True)
class KeepLastN:
    n: int

    def keep(self, versions: Sequence[VersionManifest]) -> set[str]:
        return {v.version_id for v in versions[-self.n:]} if self.n > 0 else set()


@dataclass(frozen=True)
class KeepBestN:
    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def keep(self, versions: Sequence[VersionManifest]) -> set[str]:
        scored = [v for v in versions if _metric(v, self.metric) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda v: (sign * (_metric(v, self.metric) or 0.0), -v.step))
        return {v.version_id for v in scored[: self.n]}


@dataclass(frozen=True)
class KeepEveryNSteps:
    n: int

    def keep(self, versions: Sequence[VersionManifest]) -> set[str]:
        return {v.version_id for v in versions if v.step % self.n == 0}


def _metric(v: VersionManifest, name: str) -> float | None:
    val = v.metrics.get(name)
    if isinstance(val, bool) or not isinstance(val, (int, float)) or math.isnan(val):
        return None
    return float(val)


def dependencies(v: VersionManifest) -> set[str]:
    """Version ids whose blobs ``v`` needs (delta bases and holders of referenced tensors)."""
    out = {b.base.version_id for b in v.blobs() if b.base is not None}
    out |= {r.version_id for b in v.blobs() for r in b.refs}
    out.discard(v.version_id)
    return out


def plan_retention(
    versions: Sequence[VersionManifest],
    policies: Iterable[Policy],
    protected: Iterable[str] = (),
) -> tuple[set[str], list[str]]:
    """Return (kept ids, ids to delete newest first).

    With no policies everything is kept. Protected ids (alias targets, the newest version)
    and the transitive delta bases of every kept version are always kept.
    """
    ordered = sorted(versions, key=lambda v: (v.step, v.version_id))
    policies = list(policies)
    if not policies:
        return {v.version_id for v in ordered}, []
    keep: set[str] = set(protected)
    for p in policies:
        keep |= p.keep(ordered)
    by_id = {v.version_id: v for v in ordered}
    frontier = list(keep)
    while frontier:
        vid = frontier.pop()
        v = by_id.get(vid)
        if v is None:
            continue
        for dep in dependencies(v):
            if dep not in keep:
                keep.add(dep)
                frontier.append(dep)
    # newest first: a deletion killed half-way never leaves a visible version whose delta
    # base (always older) is already gone
    delete = [v.version_id for v in reversed(ordered) if v.version_id not in keep]
    return keep, delete
