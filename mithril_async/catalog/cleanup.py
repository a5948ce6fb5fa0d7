"""What writers that died leave, and versions retention deletes: unfinished version
folders (taken over by compare-and-swap first, so a folder another job re-committed is never
removed), their temp files and uploads, a committed version's files (manifest first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Collection, Iterable

from mithril_async.catalog.claiming import _Claims, new_claim, parse_claim
from mithril_async.claims import claim_doc_stale, claim_token, describe_claim, owner_identity
from mithril_async.errors import InvalidFormat, KeyExists, KeyNotFound, PreconditionFailed
from mithril_async.manifest import version_id, version_number

log = logging.getLogger("mithril_async")

#: deletes of one version's files in flight at once
_DELETES_IN_FLIGHT = 64


class _Cleanup(_Claims):
    """The catalog's removals (see the module docstring)."""

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
        doc = parse_claim(former)
        if claim_token(doc) != token:
            return taken
        if former is not None and not claim_doc_stale(doc, bound):
            return f"its claim is live again: {describe_claim(doc)}"
        mine = json.dumps(new_claim()).encode()
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


def _claim_leftover(key: str) -> bool:
    """Whether a leftover is (the temp file of) a claim being written."""
    name = key.rsplit("/", 1)[-1]
    return name == "_claim.json" or name.startswith(".tmp-_claim.json.")
