"""A run's committed state as seen through a Store: versions, aliases, run manifest.

Readers trust only what is committed: a version exists iff its ``manifest.json`` exists (blobs
are durable before the manifest is written). Aliases are moved with compare-and-swap writes, so
two writers never lose an update: ``latest`` only ever moves to a higher step and ``best`` only
to a better metric. Every manifest read is validated, and must name keys inside its own run.

Version numbers are reserved by claims (:mod:`mithril_async.claims` says when one is
abandoned); the catalog writes, renews and reads them in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Literal

from mithril_async.claims import (
    CLAIM_STALE_S,
    Claim,
    claim_doc_stale,
    claim_token,
    describe_claim,
    owner_identity,
    process_start,
)
from mithril_async.errors import (
    InvalidFormat,
    KeyExists,
    KeyNotFound,
    PreconditionFailed,
    VersionNotFound,
)
from mithril_async.layout import RunLayout
from mithril_async.manifest import (
    MAX_METADATA_BYTES,
    AliasFile,
    BaseRef,
    RunManifest,
    VersionManifest,
    VersionSummary,
    dump_model,
    parse_model,
    utcnow,
    version_id,
    version_number,
)
from mithril_async.storage.base import Store, check_key

log = logging.getLogger("mithril_async")

_CAS_ATTEMPTS = 32
#: deletes of one version's files in flight at once
_DELETES_IN_FLIGHT = 64


class RunCatalog:
    """Read and commit the metadata of one run in one store."""

    def __init__(self, store: Store, layout: RunLayout, *,
                 claim_stale_s: float = CLAIM_STALE_S) -> None:
        self.store = store
        self.layout = layout
        #: a claim whose heartbeat is older than this is abandoned (see the module doc)
        self.claim_stale_s = claim_stale_s
        self._manifests: dict[str, VersionManifest] = {}
        self._damaged: set[str] = set()

    # ---------------------------------------------------------------- versions
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

    async def claim(self, bases: Iterable[str] = ()) -> Claim:
        """Reserve the next free version number (atomic put_if_absent of a claim file).

        The claim names its owner (:func:`owner_identity`, a random token) and ``bases``: the
        committed versions this save's deltas and references read, which retention keeps
        while the claim is live. Only the version folders' names are needed, so one level is
        listed (``list_dir``), not every blob key of the run; a number taken meanwhile just
        moves the claim on."""
        n = max(await self._folder_numbers(), default=0) + 1
        doc = _new_claim(bases)
        data = json.dumps(doc).encode()
        for _ in range(1000):
            if await self.store.list_incomplete(self.layout.version_dir(n) + "/"):
                # leftovers of an earlier owner of this number (a folder holding only temp
                # files is invisible to listings): never reused, so a committed version holds
                # exactly its own files; start-up cleanup removes the leftovers
                n += 1
                continue
            try:
                await self.store.put_if_absent(self.layout.claim_key(n), data)
                return Claim(n, doc)
            except KeyExists:
                n += 1
            except BaseException:
                # the claim may have landed before the failure (the directory fsync after the
                # link failed, a cancel): remove it, but only if it is ours, not another's
                await asyncio.shield(self._drop_claim(n, data))
                raise
        raise RuntimeError("could not claim a version number after 1000 attempts")

    async def claim_version(self) -> int:
        """Reserve the next free version number (a claim without bases or heartbeat)."""
        return (await self.claim()).number

    async def read_claim(self, n: int) -> dict[str, Any] | None:
        """Version ``n``'s claim as written; None if there is none or it is not a JSON object."""
        try:
            doc = json.loads(await self.get_metadata(self.layout.claim_key(n)))
        except (KeyNotFound, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    async def claim_is_own(self, claim: Claim) -> bool:
        """Whether ``claim``'s file still carries its token (not removed, not replaced)."""
        doc = await self.read_claim(claim.number)
        return doc is not None and doc.get("token") == claim.token

    async def renew_claim(self, claim: Claim) -> bool:
        """One heartbeat: rewrite the claim's ``hb`` with a compare-and-swap write, so a
        claim another process removed or replaced is never overwritten. False (and
        ``claim.lost`` set) once the claim is no longer ours; a failing store only logs."""
        key = self.layout.claim_key(claim.number)
        try:
            data, etag = await self.store.get_with_etag(key)
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("token") != claim.token:
                claim.lost, claim.reason = True, f"{key} was replaced by another process"
                return False
            claim.doc = {**doc, "hb": time.time()}
            await self.store.put_if_match(key, json.dumps(claim.doc).encode(), etag)
        except KeyNotFound:
            claim.lost, claim.reason = True, f"{key} was removed by another process"
            return False
        except PreconditionFailed:  # changed between read and write: the next beat decides
            return True
        except (ValueError, OSError) as err:
            log.warning("could not renew the claim %s (will retry): %r", key, err)
        return True

    async def keep_claim_alive(self, claim: Claim, interval: float) -> None:
        """Renew ``claim`` every ``interval`` seconds until cancelled or lost (a task that
        runs beside the save on its event loop)."""
        while True:
            await asyncio.sleep(interval)
            if not await self.renew_claim(claim):
                break
        if claim.lost:
            log.warning("lost the claim of %s: %s", version_id(claim.number), claim.reason)

    async def claim_is_stale(self, n: int, stale_after_s: float | None = None) -> bool:
        """Whether version ``n``'s claim is abandoned (:func:`claim_doc_stale`)."""
        return claim_doc_stale(await self.read_claim(n), self._stale_bound(stale_after_s))

    def _stale_bound(self, stale_after_s: float | None) -> float:
        return self.claim_stale_s if stale_after_s is None else stale_after_s

    async def unfinished(self, *, stale_after_s: float | None = None,
                         numbers: dict[int, bool] | None = None
                         ) -> tuple[dict[int, dict[str, Any] | None], dict[int, dict[str, Any]]]:
        """(abandoned, live) unfinished versions: version folders without a manifest, split
        by whether their claim is stale, each mapped to its claim as read (None: none, or not
        a JSON object); :meth:`remove_unfinished` takes the abandoned one's
        :func:`~mithril_async.claims.claim_token`. ``numbers``: what :meth:`version_numbers`
        returned, if the caller has just listed it."""
        bound = self._stale_bound(stale_after_s)
        me = owner_identity()
        stale: dict[int, dict[str, Any] | None] = {}
        live: dict[int, dict[str, Any]] = {}
        if numbers is None:
            numbers = await self.version_numbers()
        for n, committed in sorted(numbers.items()):
            if committed:
                continue
            doc = await self.read_claim(n)
            if doc is None or claim_doc_stale(doc, bound, me=me):
                stale[n] = doc
            else:
                live[n] = doc
        return stale, live

    async def live_claim_bases(self, committed: Collection[str]) -> set[str]:
        """Version ids named as bases by the live claims of unfinished saves: a save still
        running may be encoding deltas against them, so retention keeps them.

        ``committed``: the committed version ids. The version folders are listed one level
        deep and only the claims of the others (unfinished saves and leftovers: a few) are
        read; a folder without a claim costs one read."""
        folders = await self._folder_numbers()
        unfinished = [n for n in folders if version_id(n) not in committed]
        docs = await asyncio.gather(*(self.read_claim(n) for n in unfinished))
        me = owner_identity()
        out: set[str] = set()
        for doc in docs:
            if doc is None or claim_doc_stale(doc, self.claim_stale_s, me=me):
                continue
            bases = doc.get("bases")
            if isinstance(bases, list):
                out |= {b for b in bases if isinstance(b, str)}
        return out

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

    async def get_metadata(self, key: str, *, size_only: bool = False) -> bytes:
        """A metadata file's bytes; one over ``MAX_METADATA_BYTES`` is refused before it is
        read, so a hostile (e.g. sparse, terabyte-sized) file costs no memory."""
        size = await self.store.size(key)
        if size > MAX_METADATA_BYTES:
            raise InvalidFormat(f"{key}: metadata file of {size} bytes is implausibly large "
                                f"(limit {MAX_METADATA_BYTES})")
        return b"" if size_only else await self.store.get(key)

    async def _drop_claim(self, n: int, claim: bytes) -> None:
        with contextlib.suppress(Exception):
            if await self.store.get(self.layout.claim_key(n)) == claim:
                await self.store.delete(self.layout.claim_key(n))

    async def clean_unfinished(self, *, stale_after_s: float | None = None,
                               orphan_age_s: float = 600.0) -> list[str]:
        """Remove version folders without a manifest whose writer is gone; return them.

        A gone writer's multipart uploads and temp files are removed whatever their age: in
        a folder whose claim is abandoned (its owner provably dead, or silent for
        ``claim_stale_s``), in a committed version whose claim's owner is gone and in a
        folder whose claim is gone (:meth:`_clean_leftovers`). A live
        writer's (fresh claim) are never touched, however old (an upload's start time does
        not advance while its parts arrive); elsewhere in the run (aliases, run.json) only
        those older than ``orphan_age_s`` go: nothing there records whose they are."""
        numbers = await self.version_numbers()
        stale, live = await self.unfinished(stale_after_s=stale_after_s, numbers=numbers)
        removed = []
        for n, doc in stale.items():
            why = await self.remove_unfinished(n, claim_token(doc), stale_after_s=stale_after_s)
            if why is None:
                removed.append(self.layout.version_dir(n))
            else:
                log.info("left %s alone: %s", self.layout.version_dir(n), why)
        removed += await self._clean_leftovers(numbers, skip=set(stale) | set(live),
                                               orphan_age_s=orphan_age_s)
        await self.store.cleanup_incomplete(
            self.layout.root + "/", orphan_age_s,
            skip=[self.layout.version_dir(n) + "/" for n in live])
        return removed

    async def _clean_leftovers(self, numbers: dict[int, bool], *, skip: Collection[int],
                               orphan_age_s: float) -> list[str]:
        """Leftovers (temp files, uploads) in version folders no live writer owns: committed
        versions whose claim's owner is gone (only it ever wrote there), and folders without
        a claim (the claim of a writer killed while its folder was removed, or that lost its
        claim); return those folders.

        A claimless folder is reserved with a claim of our own first (:meth:`remove_unfinished`:
        a writer may claim the number meanwhile: then it is its folder and stays untouched;
        with ours in place nobody can, and :meth:`claim` never reuses a folder holding
        leftovers anyway). A
        ``_claim.json`` temp younger than ``orphan_age_s`` stays: it may be another
        writer's claim a moment before it is linked."""
        prefix = self.layout.versions_prefix
        folders: dict[int, list[tuple[str, float]]] = {}
        for inc in await self.store.list_incomplete(prefix):
            try:
                n = version_number(inc.key[len(prefix):].split("/", 1)[0])
            except InvalidFormat:
                continue
            if n not in skip:
                folders.setdefault(n, []).append((inc.key, inc.age_s))
        out = []
        me = owner_identity()
        for n, found in sorted(folders.items()):
            young_claim_temp = any(_claim_leftover(k) and age < orphan_age_s
                                   for k, age in found)
            folder = self.layout.version_dir(n) + "/"
            if numbers.get(n):  # committed: only its claim's owner ever wrote there
                doc = await self.read_claim(n)
                if young_claim_temp or (doc is not None and not claim_doc_stale(
                        doc, self.claim_stale_s, me=me)):
                    continue  # its owner lives on: only the age rule applies
                await self.store.cleanup_incomplete(folder)
                out.append(folder.rstrip("/"))
                log.warning("removed leftovers of a killed writer in committed %s",
                            version_id(n))
                continue
            if young_claim_temp or await self.read_claim(n) is not None:
                continue  # claimed since the listing (or about to be): not ours to clean
            if await self.remove_unfinished(n, None) is None:
                out.append(folder.rstrip("/"))
        return out

    async def claim_number(self, n: int) -> bytes:
        """Claim version number ``n`` itself (``KeyExists`` if taken) and return the claim's
        bytes: how cleanup reserves a claimless folder before it empties it."""
        data = json.dumps(_new_claim()).encode()
        await self.store.put_if_absent(self.layout.claim_key(n), data)
        return data

    async def remove_unfinished(self, n: int, token: str | None, *,
                                stale_after_s: float | None = None) -> str | None:
        """Remove abandoned unfinished version ``n`` (its temp files and uploads, its files,
        its claim last); return None once removed, else why the folder was left alone.

        ``token``: the owner token of the claim that made the folder abandoned
        (:func:`~mithril_async.claims.claim_token` of what :meth:`unfinished` read; None for a
        folder without a writer's claim). That judgement may be old (``mithril gc`` plans,
        then applies): meanwhile another process may have emptied the folder, claimed the
        number again and committed a new version there. So the folder is taken over first
        (:meth:`_take_over`): its claim, read again, must still carry ``token`` and still be
        abandoned (``stale_after_s``), and is replaced by one of this process's with a
        compare-and-swap write (a folder without a claim is reserved with ``put_if_absent``).
        Then no writer can claim the number, no other cleaner can take the folder, and a
        writer that still thinks it owns it fails its commit (``ClaimLost``). A folder holding
        a manifest is a committed version: refused before the take-over, and after it (the
        former claim is put back: a writer that had passed its claim check may have
        published). The cleaner's claim goes last, so a removal killed half-way leaves a
        claimed folder (removed at a later start), never a claimless folder of leftovers."""
        folder = self.layout.version_dir(n) + "/"
        claim = self.layout.claim_key(n)
        manifest = self.layout.manifest_key(n)
        if await self.store.exists(manifest):
            return "committed since it was judged abandoned"
        held = await self._take_over(n, token, self._stale_bound(stale_after_s))
        if isinstance(held, str):
            return held
        mine, tag, former = held
        committed = False
        try:
            committed = await self.store.exists(manifest)
            if committed:
                return "committed while it was being taken over"
            await self.store.cleanup_incomplete(folder)
            for key in await self.store.list(folder):
                if key != claim:
                    await self.store.delete(key)
        finally:
            if committed and former is not None and tag is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.store.put_if_match(claim, former, tag))
            else:
                await asyncio.shield(self._drop_claim(n, mine))
        return None

    async def _take_over(self, n: int, token: str | None, bound: float
                         ) -> tuple[bytes, str | None, bytes | None] | str:
        """Replace version ``n``'s claim, still the one with ``token`` and still abandoned
        (or still absent, for ``token`` None), by a claim of this process's: return (its
        bytes, its tag or None when it was created, the former claim's bytes or None), or why
        the folder must be left alone (another claim, a live one, one changed meanwhile)."""
        key = self.layout.claim_key(n)
        taken = "claimed by another process since it was judged abandoned"
        try:
            await self.get_metadata(key, size_only=True)
            former: bytes | None
            former, etag = await self.store.get_with_etag(key)
        except KeyNotFound:
            former, etag = None, None
        except InvalidFormat as err:  # an implausibly large claim file: never a writer's
            return f"claim unreadable: {err}"
        doc = _parse_claim(former)
        if claim_token(doc) != token:
            return taken
        if former is not None and not claim_doc_stale(doc, bound):
            return f"its claim is live again: {describe_claim(doc)}"
        mine = json.dumps(_new_claim()).encode()
        try:
            if etag is None:
                await self.store.put_if_absent(key, mine)
                return mine, None, None
            return mine, await self.store.put_if_match(key, mine, etag), former
        except (KeyExists, PreconditionFailed):
            return taken
        except BaseException:  # the write may have landed before the failure (a cancel)
            await asyncio.shield(self._drop_claim(n, mine))
            raise

    async def delete_version(self, vid: str) -> None:
        """Delete a version: manifest first (it disappears atomically), then its claim (so a
        deletion killed half-way leaves an unclaimed folder that the next start removes),
        then its files.

        The files go concurrently (``_DELETES_IN_FLIGHT`` at a time: a version of thousands
        of ranks holds thousands of files). Once the manifest is gone, a failing delete (e.g.
        the directory fsync after an unlink) does not stop the others: the rest is removed
        and the first error raised, so a long-running process does not keep an unclaimed
        half-deleted folder until restart.
        The claim goes before the folder is listed, and a failed claim delete is tried once
        more at the end: a claim without a manifest looks like a save in progress (retention
        reads it, keeps what it names), a claimless folder is plain garbage."""
        n = version_number(vid)
        mkey = self.layout.manifest_key(n)
        errors: list[Exception] = []
        try:
            await self.store.delete(mkey)
        except Exception as err:
            if await self.store.exists(mkey):
                raise  # still committed: its claim and files stay with it
            errors.append(err)
        self._manifests.pop(mkey, None)
        claim = self.layout.claim_key(n)
        claim_errors = await self.delete_keys([claim])
        errors += claim_errors
        try:
            rest = [k for k in await self.store.list(self.layout.version_dir(n) + "/")
                    if k != claim]
        except Exception as err:
            errors.append(err)
            rest = []
        errors += await self.delete_keys(rest)
        if claim_errors:
            errors += await self.delete_keys([claim])
        if errors:
            raise errors[0]

    async def delete_keys(self, keys: Iterable[str]) -> list[Exception]:
        """Delete ``keys``, :data:`_DELETES_IN_FLIGHT` at a time (a version of thousands of
        ranks holds thousands of files); every key is tried, the errors are returned."""
        errors: list[Exception] = []
        slots = asyncio.Semaphore(_DELETES_IN_FLIGHT)

        async def one(key: str) -> None:
            async with slots:
                try:
                    await self.store.delete(key)
                except Exception as err:
                    errors.append(err)

        await asyncio.gather(*(one(k) for k in keys))
        return errors

    # ---------------------------------------------------------------- aliases
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

    # ---------------------------------------------------------------- run manifest
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

    # ---------------------------------------------------------------- resolution
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


def _new_claim(bases: Iterable[str] = ()) -> dict[str, Any]:
    """A claim document of this process: its identity, a fresh token, the time, ``bases``."""
    now = time.time()
    return {**owner_identity(), "start": process_start(os.getpid()),
            "token": secrets.token_hex(16), "t": now, "hb": now, "bases": sorted(set(bases))}


def _parse_claim(data: bytes | None) -> object:
    """A claim file's parsed JSON; None where there is none or it is not JSON."""
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _claim_leftover(key: str) -> bool:
    """Whether a leftover is (the temp file of) a claim being written."""
    name = key.rsplit("/", 1)[-1]
    return name == "_claim.json" or name.startswith(".tmp-_claim.json.")


def _usable(value: object) -> bool:
    """Whether a metric value can rank versions (a real number, not bool or NaN)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not math.isnan(value))


def open_catalog(runs_dir: str | os.PathLike[str], run_id: str) -> RunCatalog:
    """The catalog of ``<runs_dir>/<run_id>`` on local disk (keys relative to its parent), for
    tools that read a run without a manager."""
    from pathlib import Path

    from mithril_async.storage.local import LocalStore

    runs = Path(runs_dir).expanduser().absolute()
    return RunCatalog(LocalStore(runs.parent), RunLayout(runs.name, run_id))
