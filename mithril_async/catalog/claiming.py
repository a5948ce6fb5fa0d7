"""Version claims in the store: reserving the next version number, renewing the claim's
heartbeat, telling an abandoned claim (:mod:`mithril_async.claims` says when) from a live
one, and the delta bases live claims still need.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Collection, Iterable
from typing import Any

from mithril_async.catalog.reads import _Reads
from mithril_async.claims import Claim, claim_doc_stale, owner_identity, process_start
from mithril_async.errors import KeyExists, KeyNotFound, PreconditionFailed
from mithril_async.manifest import version_id

log = logging.getLogger("mithril_async")


class _Claims(_Reads):
    """The catalog's version claims (see the module docstring)."""

    async def claim(self, bases: Iterable[str] = ()) -> Claim:
        """Reserve the next free version number (atomic put_if_absent of a claim file).

        The claim names its owner (:func:`owner_identity`, a random token) and ``bases``: the
        committed versions this save's deltas and references read, which retention keeps
        while the claim is live. Only the version folders' names are needed, so one level is
        listed (``list_dir``), not every blob key of the run; a number taken meanwhile just
        moves the claim on."""
        n = max(await self._folder_numbers(), default=0) + 1
        doc = new_claim(bases)
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

    async def _drop_claim(self, n: int, claim: bytes) -> None:
        with contextlib.suppress(Exception):
            if await self.store.get(self.layout.claim_key(n)) == claim:
                await self.store.delete(self.layout.claim_key(n))

    async def claim_number(self, n: int) -> bytes:
        """Claim version number ``n`` itself (``KeyExists`` if taken) and return the claim's
        bytes: how cleanup reserves a claimless folder before it empties it."""
        data = json.dumps(new_claim()).encode()
        await self.store.put_if_absent(self.layout.claim_key(n), data)
        return data


def new_claim(bases: Iterable[str] = ()) -> dict[str, Any]:
    """A claim document of this process: its identity, a fresh token, the time, ``bases``."""
    now = time.time()
    return {**owner_identity(), "start": process_start(os.getpid()),
            "token": secrets.token_hex(16), "t": now, "hb": now, "bases": sorted(set(bases))}


def parse_claim(data: bytes | None) -> object:
    """A claim file's parsed JSON; None where there is none or it is not JSON."""
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None
