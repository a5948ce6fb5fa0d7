"""A run's committed versions as the catalog reads them: version numbers, manifests
(validated, and remembered once read), committed steps, metadata.

Readers trust only what is committed: a version exists iff its ``manifest.json`` exists (blobs
are durable before the manifest is written). Every manifest read is validated, and must name
keys inside its own run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from mithril_async.claims import CLAIM_STALE_S
from mithril_async.errors import InvalidFormat, KeyNotFound
from mithril_async.layout import RunLayout
from mithril_async.manifest import (
    MAX_METADATA_BYTES,
    BaseRef,
    RunManifest,
    VersionManifest,
    parse_model,
    version_id,
    version_number,
)
from mithril_async.storage.base import Store, check_key

log = logging.getLogger("mithril_async")


class _Reads:
    """The catalog's reads (see the module docstring)."""

    def __init__(self, store: Store, layout: RunLayout, *,
                 claim_stale_s: float = CLAIM_STALE_S) -> None:
        self.store = store
        self.layout = layout
        #: a claim whose heartbeat is older than this is abandoned (see the module doc)
        self.claim_stale_s = claim_stale_s
        self._manifests: dict[str, VersionManifest] = {}
        self._damaged: set[str] = set()

    async def version_numbers(self) -> dict[int, bool]:
        """Every version number present, mapped to whether it is committed.

        One level of ``versions/`` is listed (the version folders' names) and each folder's
        manifest is looked up, all at once: never a listing of every blob of every kept
        version, which grows with ranks x files x versions (thousands of pages per save
        for a job of thousands of ranks)."""
        numbers = await self._folder_numbers()
        committed = await asyncio.gather(*(self.store.exists(self.layout.manifest_key(n))
                                           for n in numbers))
        return dict(zip(numbers, committed, strict=True))

    async def _folder_numbers(self) -> list[int]:
        """The numbers of the version folders present, committed or not."""
        out = []
        for name in (await self.store.list_dir(self.layout.versions_prefix)).dirs:
            try:
                out.append(version_number(name))
            except InvalidFormat:
                continue
        return out

    async def read_manifest(self, key: str) -> VersionManifest:
        _check_manifest_key(self.layout, key)
        cached = self._manifests.get(key)
        if cached is not None:
            return cached
        m = parse_model(VersionManifest, await self.get_metadata(key), key)
        check_manifest(self.layout, key, m)
        self._manifests[key] = m
        return m

    def remember(self, key: str, m: VersionManifest) -> None:
        """Cache manifest ``m``, which this process has just committed at ``key``, so that
        listing the versions does not read it back (a manifest of thousands of ranks takes
        a noticeable part of a second to parse). It must pass the checks of a read."""
        check_manifest(self.layout, key, m)
        self._manifests[key] = m

    async def versions(self, *, skip_damaged: bool = False) -> list[VersionManifest]:
        """All committed versions, oldest step first.

        ``skip_damaged``: a manifest that does not validate (or vanished since the listing)
        is left out with a warning instead of failing the whole listing, so one damaged
        version cannot stop a manager from starting, saving or falling back to an older one.
        Restoring that version itself still raises. ``mithril verify`` lists strictly."""
        nums = await self.version_numbers()
        out = []
        for n, committed in sorted(nums.items()):
            if committed:
                key = self.layout.manifest_key(n)
                try:
                    out.append(await self.read_manifest(key))
                except (InvalidFormat, KeyNotFound) as err:
                    if not skip_damaged:
                        raise
                    self._skip_damaged(key, err)
        out.sort(key=lambda m: (m.step, m.version_id))
        return out

    async def committed_steps(self) -> set[int]:
        """The steps of the committed versions, without parsing every kept manifest.

        A manifest of thousands of ranks takes a noticeable part of a second to parse, and
        every rank of a job asks this when its manager starts. ``run.json`` names each
        version's step; it is trusted only for versions committed now (the folder listing
        decides which) and any committed version it does not name (a run.json update lost
        to a crash or a race, or a damaged run.json) is read from its manifest. Damaged
        manifests are left out, as in ``versions(skip_damaged=True)``."""
        nums = await self.version_numbers()
        committed = {version_id(n): n for n, c in nums.items() if c}
        known: dict[str, int] = {}
        key = self.layout.run_manifest_key
        with contextlib.suppress(KeyNotFound, InvalidFormat):
            run = parse_model(RunManifest, await self.get_metadata(key), key)
            known = {v.version_id: v.step for v in run.versions if v.version_id in committed}
        steps = set(known.values())
        for vid in sorted(set(committed) - set(known)):
            mkey = self.layout.manifest_key(committed[vid])
            try:
                steps.add((await self.read_manifest(mkey)).step)
            except (InvalidFormat, KeyNotFound) as err:
                self._skip_damaged(mkey, err)
        return steps

    def _skip_damaged(self, key: str, err: Exception) -> None:
        """A damaged (or vanished) manifest left out of a listing: warned about once."""
        if key not in self._damaged:
            self._damaged.add(key)
            log.warning("ignoring version %s: %s", key, err)

    async def get_metadata(self, key: str, *, size_only: bool = False) -> bytes:
        """A metadata file's bytes; one over ``MAX_METADATA_BYTES`` is refused before it is
        read, so a hostile (e.g. sparse, terabyte-sized) file costs no memory."""
        size = await self.store.size(key)
        if size > MAX_METADATA_BYTES:
            raise InvalidFormat(f"{key}: metadata file of {size} bytes is implausibly large "
                                f"(limit {MAX_METADATA_BYTES})")
        return b"" if size_only else await self.store.get(key)

    async def missing_bases(self, refs: Iterable[BaseRef]) -> list[BaseRef]:
        """Those of ``refs`` (delta bases, tensor holders) whose version is no longer
        committed or whose blob is gone: a blob encoded against them would not restore."""
        unique = {(r.version_id, r.key): r for r in refs}

        async def gone(r: BaseRef) -> bool:
            try:
                mkey = self.layout.manifest_key(version_number(r.version_id))
            except InvalidFormat:
                return True
            return not (await self.store.exists(mkey) and await self.store.exists(r.key))

        flags = await asyncio.gather(*(gone(r) for r in unique.values()))
        return [r for r, g in zip(unique.values(), flags, strict=True) if g]


def _check_manifest_key(layout: RunLayout, key: str) -> None:
    check_key(key)
    if not layout.owns(key):
        raise InvalidFormat(f"manifest key {key!r} is outside run {layout.root!r}")


def check_manifest(layout: RunLayout, key: str, m: VersionManifest) -> None:
    """The checks every manifest read passes, wherever its bytes came from: ``key`` is a safe
    key of ``layout``'s run and the manifest key of ``m``'s version, ``m`` names this run, and
    every blob, RNG and config key it names lies inside the run (blobs may be shared with
    earlier versions, never other runs). :class:`InvalidFormat` (``UnsafeKey``) naming what
    is wrong."""
    _check_manifest_key(layout, key)
    if m.run_id != layout.run_id:
        raise InvalidFormat(f"{key}: names run {m.run_id!r}, expected {layout.run_id!r}")
    expected = layout.manifest_key(version_number(m.version_id))
    if expected != key:
        raise InvalidFormat(f"{key}: claims version {m.version_id} (expected at {expected})")
    for k in m.all_keys():
        if not layout.owns(k):
            raise InvalidFormat(f"{key}: names key {k!r} outside its run")
    if m.config is not None and not layout.owns(m.config.key):  # verify reads it
        raise InvalidFormat(f"{key}: names config key {m.config.key!r} outside its run")
