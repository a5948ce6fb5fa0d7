"""Preservation policies: which committed versions to keep.

Each policy is a small class answering "which of these versions do you want kept?"; the
union of all policies' answers is kept, everything else may be deleted — except what an alias
points to, the newest version, and every delta base a kept version depends on
(:func:`plan_retention` adds those, transitively). Retention runs only after a new version has
committed, and from ``mithril gc``; both go through :func:`apply_retention` /
:func:`plan_deletions`, so they can never disagree on what is safe to delete.

A policy is anything with ``keep(versions) -> set[str]`` (:class:`Policy`): write your own and
pass it as ``CheckpointManager(..., retention=policy)``. The flat config options
(``keep_last``, ``keep_best``, ``keep_every_n_steps``) are mapped to one policy by
:func:`from_config`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from mithril_async.manifest import VersionManifest

if TYPE_CHECKING:
    from mithril_async.catalog import RunCatalog
    from mithril_async.config import CheckpointingConfig

__all__ = ["KeepAny", "KeepBestN", "KeepEveryNSteps", "KeepLastN", "Policy", "apply_retention",
           "dependencies", "from_config", "from_options", "plan_deletions", "plan_retention"]


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


@dataclass(frozen=True)
class KeepAny:
    """Keeps what any of its policies keeps (how the config's options combine)."""

    policies: tuple[Policy, ...]

    def keep(self, versions: Sequence[VersionManifest]) -> set[str]:
        out: set[str] = set()
        for p in self.policies:
            out |= p.keep(versions)
        return out


def from_options(*, keep_last: int | None = None, keep_best: int | None = None,
                 metric: str | None = None, mode: Literal["min", "max"] = "min",
                 keep_every_n_steps: int | None = None) -> Policy | None:
    """One policy for the flat options (None: no option set, keep everything).

    ``keep_best`` without a ``metric`` is ignored: a run without a best metric has no best."""
    out: list[Policy] = []
    if keep_last:
        out.append(KeepLastN(keep_last))
    if keep_best and metric:
        out.append(KeepBestN(keep_best, metric, mode))
    if keep_every_n_steps:
        out.append(KeepEveryNSteps(keep_every_n_steps))
    if not out:
        return None
    return out[0] if len(out) == 1 else KeepAny(tuple(out))


def from_config(cfg: CheckpointingConfig) -> Policy | None:
    """The policy ``[checkpointing]`` asks for (``keep_last``, ``keep_best``, ...)."""
    return from_options(keep_last=cfg.keep_last, keep_best=cfg.keep_best,
                        metric=cfg.best_metric_name, mode=cfg.best_mode,
                        keep_every_n_steps=cfg.keep_every_n_steps)


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
    policy: Policy | None,
    protected: Iterable[str] = (),
) -> tuple[set[str], list[str]]:
    """Return (kept ids, ids to delete newest first).

    With no policy everything is kept. Protected ids (alias targets, the newest version)
    and the transitive delta bases of every kept version are always kept.
    """
    ordered = sorted(versions, key=lambda v: (v.step, v.version_id))
    if policy is None:
        return {v.version_id for v in ordered}, []
    keep: set[str] = set(protected) | policy.keep(ordered)
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


async def plan_deletions(catalog: RunCatalog, policy: Policy | None, *,
                         versions: Sequence[VersionManifest] | None = None
                         ) -> list[VersionManifest]:
    """The committed versions ``policy`` lets go, newest first (nothing is deleted).

    Always kept: the targets of ``latest`` and ``best``, the newest version (it may be a
    version whose alias move a killed writer never made), every base a live save of another
    process names in its claim (it may be encoding deltas against it right now), and every
    delta base of a kept one. ``versions``: the run's committed versions, oldest first, if
    the caller has them.
    """
    if policy is None:
        return []
    if versions is None:
        versions = await catalog.versions(skip_damaged=True)
    if not versions:
        return []
    protected = {versions[-1].version_id}
    for name in ("latest", "best"):
        alias = await catalog.read_alias(name)
        if alias is not None and alias.version_id:
            protected.add(alias.version_id)
    # read last, right before the caller deletes: a claim written later re-checks its bases
    protected |= await catalog.live_claim_bases({v.version_id for v in versions})
    _, delete = plan_retention(versions, policy, protected)
    by_id = {v.version_id: v for v in versions}
    return [by_id[vid] for vid in delete]


async def apply_retention(catalog: RunCatalog, policy: Policy | None, *,
                          versions: Sequence[VersionManifest] | None = None
                          ) -> list[VersionManifest]:
    """Delete what ``policy`` lets go (newest first); return the deleted versions.

    Newest first: a deletion killed half-way never leaves a visible version whose delta base
    (always older) is already gone."""
    deleted = []
    for v in await plan_deletions(catalog, policy, versions=versions):
        await catalog.delete_version(v.version_id)
        deleted.append(v)
    return deleted
