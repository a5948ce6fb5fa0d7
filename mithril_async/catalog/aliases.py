"""The run's aliases and ``run.json``: ``latest`` and ``best`` moved by compare-and-swap
writes, so two writers never lose an update (``latest`` only ever moves to a higher step,
``best`` only to a better metric), repaired after a crash, and the run manifest rewritten
from the committed versions; and resolving a target (an alias, a version, a step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

from mithril_async.catalog.cleanup import _Cleanup
from mithril_async.errors import (
    InvalidFormat,
    KeyExists,
    KeyNotFound,
    PreconditionFailed,
    VersionNotFound,
)
from mithril_async.manifest import (
    AliasFile,
    RunManifest,
    VersionManifest,
    VersionSummary,
    dump_model,
    parse_model,
    utcnow,
    version_number,
)
from mithril_async.storage.base import check_key

log = logging.getLogger("mithril_async")

_CAS_ATTEMPTS = 32


class _Aliases(_Cleanup):
    """The catalog's aliases and run manifest (see the module docstring)."""

    async def read_alias(self, name: str) -> AliasFile | None:
        key = self.layout.alias_key(name)
        try:
            data = await self.get_metadata(key)
        except KeyNotFound:
            return None
        alias = parse_model(AliasFile, data, key)
        if alias.manifest_key is not None and not self.layout.owns(alias.manifest_key):
            raise InvalidFormat(f"{key}: points outside its run: {alias.manifest_key!r}")
        return alias

    async def _cas(self, name: str, decide: Callable[[AliasFile | None], AliasFile | None]
                   ) -> AliasFile | None:
        """Read-decide-write ``aliases/<name>.json`` until no other writer interferes."""
        key = self.layout.alias_key(name)
        for _ in range(_CAS_ATTEMPTS):
            try:
                await self.get_metadata(key, size_only=True)
                data, etag = await self.store.get_with_etag(key)
            except KeyNotFound:
                data, etag = None, None
            current: AliasFile | None = None
            if data is not None:
                try:
                    current = parse_model(AliasFile, data, key)
                except InvalidFormat as err:  # derived data: rewritten, never trusted
                    log.warning("alias %s is damaged (%s); rewriting it", key, err)
            new = decide(current)
            if new is None:
                return current
            try:
                await self.store.put_if_match(key, dump_model(new), etag)
                return new
            except (PreconditionFailed, KeyExists):
                continue
        raise PreconditionFailed(f"alias {key}: too much contention ({_CAS_ATTEMPTS} attempts)")

    async def ensure_best_pending(self, metric: str | None, mode: str) -> None:
        """``best.json`` always exists; it is ``pending`` until a usable metric appears."""

        def decide(cur: AliasFile | None) -> AliasFile | None:
            if cur is not None:
                return None
            return AliasFile(name="best", status="pending", run_id=self.layout.run_id,
                             metric_name=metric, mode=mode,
                             updated_at=utcnow())

        await self._cas("best", decide)

    async def move_latest(self, m: VersionManifest, key: str) -> bool:
        """Point ``latest`` at ``m`` unless it already names a later step, or ``m`` is held
        (NaN/Inf, :attr:`VersionManifest.held`); return if moved."""
        if m.held:
            return False
        moved = False

        def decide(cur: AliasFile | None) -> AliasFile | None:
            nonlocal moved
            moved = cur is None or cur.step is None or (cur.step, cur.version_id or "") < (
                m.step, m.version_id)
            if not moved:
                return None
            return AliasFile(name="latest", status="ok", run_id=m.run_id,
                             version_id=m.version_id, step=m.step, manifest_key=key,
                             updated_at=utcnow())

        await self._cas("latest", decide)
        return moved

    async def move_alias(self, name: str, m: VersionManifest, key: str) -> bool:
        """Point ``aliases/<name>.json`` at ``m`` unless it already names ``m``'s version or
        a later one (by version number; the tier layer's ``latest_local``, ...), or ``m`` is
        held (NaN/Inf); return whether it moved. Compare-and-swap, like ``latest``."""
        if m.held:
            return False
        moved = False

        def decide(cur: AliasFile | None) -> AliasFile | None:
            nonlocal moved
            moved = cur is None or cur.version_id is None or cur.version_id < m.version_id
            if not moved:
                return None
            return AliasFile(name=name, status="ok", run_id=m.run_id, version_id=m.version_id,
                             step=m.step, manifest_key=key, updated_at=utcnow())

        await self._cas(name, decide)
        return moved

    async def move_best(self, m: VersionManifest, key: str, metric: str | None,
                        mode: Literal["min", "max"]) -> bool:
        """Point ``best`` at ``m`` if its metric is usable and better than the current one,
        and ``m`` is not held (NaN/Inf)."""
        if m.held:
            return False
        value = m.metrics.get(metric) if metric else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return False
        moved = False

        def decide(cur: AliasFile | None) -> AliasFile | None:
            nonlocal moved
            moved = True
            if cur is not None and cur.status == "ok" and cur.metric_value is not None:
                moved = value < cur.metric_value if mode == "min" else value > cur.metric_value
            if not moved:
                return None
            return AliasFile(name="best", status="ok", run_id=m.run_id, version_id=m.version_id,
                             step=m.step, manifest_key=key, metric_name=metric,
                             metric_value=float(value), mode=mode, updated_at=utcnow())

        await self._cas("best", decide)
        return moved

    async def repair_aliases(self, metric: str | None, mode: Literal["min", "max"]) -> bool:
        """Finish the alias moves of a writer killed between its manifest and its aliases:
        ``latest`` to the newest committed version, ``best`` to the best one. Both moves are
        the usual monotone CAS writes, so a live writer's update is never undone. Held
        versions (NaN/Inf) are never alias targets."""
        versions = [m for m in await self.versions(skip_damaged=True) if not m.held]
        if not versions:
            return False
        newest = versions[-1]
        moved = await self.move_latest(
            newest, self.layout.manifest_key(version_number(newest.version_id)))
        usable = [m for m in versions if metric and _usable(m.metrics.get(metric))]
        if usable:
            pick = min if mode == "min" else max
            best = pick(usable, key=lambda m: float(m.metrics[metric or ""]))
            moved |= await self.move_best(
                best, self.layout.manifest_key(version_number(best.version_id)), metric, mode)
        return moved

    async def update_run_manifest(self, root_local: str | None, root_remote: str | None, *,
                                  versions: list[VersionManifest] | None = None) -> None:
        """Rewrite run.json from the committed versions and aliases (CAS, best effort).

        ``versions``: the committed versions if the caller has just listed them (a commit
        lists once for run.json and retention both)."""
        if versions is None:
            versions = await self.versions(skip_damaged=True)
        latest = await self.read_alias("latest")
        best = await self.read_alias("best")
        key = self.layout.run_manifest_key
        for _ in range(_CAS_ATTEMPTS):
            try:
                await self.get_metadata(key, size_only=True)
                data, etag = await self.store.get_with_etag(key)
                created = parse_model(RunManifest, data, key).created_at
            except KeyNotFound:
                etag, created = None, utcnow()
            run = RunManifest(
                run_id=self.layout.run_id, created_at=created,
                paths={"root_local": root_local, "root_remote": root_remote},
                aliases={"latest": latest.version_id if latest else None,
                         "best": best.version_id if best else None},
                versions=[VersionSummary(version_id=v.version_id, step=v.step,
                                         created_at=v.created_at,
                                         model_key=v.model.key if v.model else None,
                                         metrics=v.metrics,
                                         bytes=sum(b.bytes for b in v.blobs()),
                                         held=v.held)
                          for v in versions],
            )
            try:
                await self.store.put_if_match(key, dump_model(run), etag)
                return
            except (PreconditionFailed, KeyExists):
                continue

    async def resolve(self, target: str | int) -> str:
        """Manifest key for "latest", "best", a version id, a step or a manifest key."""
        if isinstance(target, bool):
            raise VersionNotFound(f"not a restore target: {target!r}")
        if isinstance(target, int):
            for m in reversed(await self.versions(skip_damaged=True)):
                if m.step == target:
                    return self.layout.manifest_key(version_number(m.version_id))
            raise VersionNotFound(f"run {self.layout.run_id}: no committed version at step "
                                  f"{target}")
        if target in ("latest", "best"):
            alias = await self.read_alias(target)
            if alias is None or alias.manifest_key is None:
                raise VersionNotFound(f"run {self.layout.run_id}: alias {target!r} points at "
                                      "no version yet")
            if not await self.store.exists(alias.manifest_key):
                raise VersionNotFound(f"alias {target!r} points at missing manifest "
                                      f"{alias.manifest_key}")
            return alias.manifest_key
        if target.startswith("v") and target[1:].isdigit():
            key = self.layout.manifest_key(version_number(target))
        elif target.endswith("manifest.json"):
            key = check_key(target)
        else:
            raise VersionNotFound(f"not a restore target: {target!r} (use 'latest', 'best', a "
                                  "version id like 'v000003', a step or a manifest key)")
        if not self.layout.owns(key) or not await self.store.exists(key):
            raise VersionNotFound(f"run {self.layout.run_id}: no committed version {target!r}")
        return key


def _usable(value: object) -> bool:
    """Whether a metric value can rank versions (a real number, not bool or NaN)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not math.isnan(value))
