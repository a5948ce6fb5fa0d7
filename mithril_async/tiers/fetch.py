"""Getting every file a rank's restore reads onto its node: own folders, peers, the remote.

For each file (:func:`~mithril_async.tiers.files.files_to_restore`): this node's folder, then
the copies the node keeps (:func:`from_node_folder`); else a rank whose folder holds a copy
sends it over the tier group (:func:`fetch`: its owner's node folder, then each replica holder
in turn; for a version of another world size, the ranks that announced it), one plan computed
alike on every rank, round after round until every holder was tried; only then a GET from the
remote. What a recovery found is its :class:`Recovery` record.

How copies are checked: ``light`` (a restore): a file in the node's folders by presence and
size, a peer's copy by size; the manager's one reader verifies what it reads while it restores,
and a repair round follows if it finds damage (:mod:`~mithril_async.tiers.restore`). Files of
at most :data:`SMALL` bytes, and every copy from the remote, are hashed on arrival. Otherwise
(strict, a repair) every copy is hashed whole against the manifest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import xxhash

from mithril_async.errors import ChecksumMismatch, DistributedError, KeyNotFound
from mithril_async.manifest import VersionManifest
from mithril_async.storage.base import Store
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.files import Need, every_file, intact, owner_of
from mithril_async.tiers.recovery import Chosen, Held, Inventory
from mithril_async.tiers.replicate import mapped
from mithril_async.tiers.sources import OWN_FOLDER, OWN_REPLICA, REMOTE, Place, Source

log = logging.getLogger("mithril_async")

#: files a recovery fetched that are at most this big are hashed on arrival and written into
#: the node folder before the restore (the next save reads the run's config file there; RNG
#: files are tiny); larger ones are served to the reader from memory and written back in the
#: background
SMALL = 1 << 20

#: one transfer of a fetch round: (asking rank, sending rank, tag, sender's folder, key)
Transfer = tuple[int, int, int, Place, str]


@dataclass
class Recovery:
    """One recovery on this rank: the version, where each file it needs is, what is hashed."""

    vid: str
    manifest: VersionManifest
    inv: list[Inventory]
    needs: list[Need]
    t0: float
    marks: dict[str, float]
    #: the manifest's bytes (checked by the reader's checks)
    mdata: bytes
    #: for a version saved by another world size: the files each rank holds; None otherwise
    held: list[Held] | None = None
    #: the size up to which fetched copies are hashed on arrival (:data:`SMALL`)
    small: int = SMALL
    #: key -> where the copy in use lies
    sources: dict[str, Source] = field(default_factory=dict)
    #: copies fetched into memory, by key (files in the node's own folders are not here)
    data: dict[str, bytes | memoryview] = field(default_factory=dict)
    #: copies hashed whole against the manifest (the others the reader verifies)
    verified: set[str] = field(default_factory=set)
    #: key -> the places whose copy did not verify (not asked again)
    tried: dict[str, set[Source]] = field(default_factory=dict)
    #: copies already written into the node folder
    written: set[str] = field(default_factory=set)
    #: whether this recovery wrote the manifest into the node folder, and the files it wrote
    #: there that the folder did not hold (what a failed restore takes back)
    manifest_created: bool = False
    created: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, chosen: Chosen, needs: list[Need], t0: float, marks: dict[str, float]
           ) -> Recovery:
        return cls(chosen.vid, chosen.manifest, chosen.inv, needs, t0, marks, chosen.mdata,
                   held=chosen.held, small=SMALL)

    def mark(self, phase: str) -> None:
        """Seconds from the recovery's start to the end of ``phase``."""
        self.marks[phase] = time.perf_counter() - self.t0

    def fetched(self) -> list[str]:
        """The files whose copy in use is not in this node's own folder."""
        return [k for k, s in self.sources.items() if s != OWN_FOLDER]

    def damaged(self, key: str, where: Source) -> None:
        """The copy of ``key`` from ``where`` did not verify: not asked again."""
        self.tried.setdefault(key, set()).add(where)

    def overlay(self, replica: Store) -> dict[str, bytes | memoryview | Store]:
        """What the node folder serves from elsewhere while the reader restores."""
        out: dict[str, bytes | memoryview | Store] = {}
        for key, src in self.sources.items():
            if key in self.data:
                out[key] = self.data[key]
            elif src == OWN_REPLICA:
                out[key] = replica
        return out


async def from_node_folder(ctx: TierContext, rec: Recovery, n: Need, light: bool) -> None:
    """Take ``n`` from this node's folder, else the node's replica folder, if a copy there
    passes the check (``light``: presence and size; else the whole XXH64)."""
    tried = rec.tried.get(n.key, set())
    for store, where in ((ctx.store.local, OWN_FOLDER), (ctx.replica, OWN_REPLICA)):
        if where in tried:
            continue
        if light:
            try:
                size = await store.size(n.key)
            except (KeyNotFound, FileNotFoundError):
                continue
            if n.bytes is None or size == n.bytes:
                rec.sources[n.key] = where
                return
        else:
            blob = await _get_or_none(store, n.key)
            if intact(blob, n):
                assert blob is not None
                rec.sources[n.key] = where
                rec.verified.add(n.key)
                if where != OWN_FOLDER:
                    rec.data[n.key] = blob
                return
            if blob is not None:
                rec.damaged(n.key, where)


async def fetch(ctx: TierContext, rec: Recovery, missing: list[str], *, verify: bool) -> None:
    """Collective: every rank's ``missing`` files from the ranks whose folders hold a copy
    (module docstring), else the remote. A copy is accepted by size (``verify``, or a file of
    at most ``rec.small`` bytes: by XXH64); places whose copy was damaged before are not asked
    again. :class:`DistributedError` on every rank when a file is intact nowhere."""
    by_key = every_file(rec.manifest)
    by_key.update({n.key: n for n in rec.needs})
    while True:
        wants = await ctx.gather(
            [(k, sorted({s.rank for s in rec.tried.get(k, ()) if s.rank is not None}))
             for k in missing if k not in rec.sources], "tiers: recovery needs")
        plan = _plan(ctx, rec, wants)
        if not plan:  # every rank computed the same plan: all leave the loop together
            break
        await _round(ctx, rec, plan, by_key, verify)
    rec.mark("peers")
    error = await _from_remote(ctx, rec, [k for k in missing if k not in rec.sources], by_key)
    rec.mark("remote")
    statuses = await ctx.gather(error, "tiers: recovery status")
    bad = [s for s in statuses if s is not None]
    if bad:
        raise DistributedError(f"tier recovery of {rec.vid} failed: {bad[0]}")


def _plan(ctx: TierContext, rec: Recovery, wants: list[list[tuple[str, list[int]]]]
          ) -> list[Transfer]:
    """Every file a rank wants from a peer this round, from the first holder (owner's node
    folder, then replica holders in order; with a reshard, the ranks that announced it) that
    is not in the asker's own folders and whose copy did not fail the asker before. The same
    plan, and tags, on every rank."""
    plan: list[Transfer] = []
    tag = 0
    for r in range(ctx.world):
        for key, skip in wants[r]:
            if rec.held is None:  # the same world: the fixed mapping names the holders
                owner = owner_of(key)
                cands = [(owner, Place.NODE)] + [(h, Place.REPLICA) for h in ctx.holders(owner)]
                cands = [(c, p) for c, p in cands if rec.vid in rec.inv[c].of(p)]
            else:  # a reshard: the ranks that said they hold the file, own copies first
                cands = [(c, p) for p in (Place.NODE, Place.REPLICA) for c in range(ctx.world)
                         if key in rec.held[c].of(p)]
            pick = next(((c, p) for c, p in cands if c != r and c not in skip
                         and not ctx.same_folder(c, r)), None)
            if pick is not None:
                tag += 1
                plan.append((r, pick[0], tag, pick[1], key))
    return plan


async def _round(ctx: TierContext, rec: Recovery, plan: list[Transfer],
                 by_key: dict[str, Need], verify: bool) -> None:
    """One exchange of ``plan``: this rank sends the copies asked of it (mapped, or an empty
    message for one it cannot read) and checks the ones it receives; a copy that is damaged
    or missing marks its sender as tried for that file."""
    mine = [(d, t, p, k) for d, c, t, p, k in plan if c == ctx.rank]
    datas = await asyncio.gather(*(
        mapped(ctx.store.local if p is Place.NODE else ctx.replica, k) for _, _, p, k in mine))
    sends = [(d, t, data) for (d, t, _, _), data in zip(mine, datas, strict=True)]
    del datas
    recvs = [(c, t) for d, c, t, _, _ in plan if d == ctx.rank]
    meta = {t: (c, p, k) for d, c, t, p, k in plan if d == ctx.rank}
    peers = sorted({d for d, _, _ in sends} | {c for c, _ in recvs})
    fetched = await ctx.exchange(sends, recvs,
                                 f"recovery of {rec.vid}: files to/from rank(s) {peers}")
    sends.clear()
    for t, blob in fetched.items():
        c, place, key = meta[t]
        need = by_key[key]
        # small files are hashed here whatever ``verify`` says: they are written into the
        # node folder before the restore, and the run's config is not something the reader
        # reads (the next save records it)
        hashed = verify or len(blob) <= rec.small
        ok = intact(blob, need) if hashed else (
            len(blob) > 0 and (need.bytes is None or len(blob) == need.bytes))
        if ok:
            rec.data[key], rec.sources[key] = blob, Source.peer(c, place)
            if hashed:
                rec.verified.add(key)
        else:
            rec.damaged(key, Source.peer(c, place))
            log.warning("%s: the copy from rank %d (%s) is damaged or missing; trying the "
                        "next holder", key, c, place.value)


async def _from_remote(ctx: TierContext, rec: Recovery, missing: list[str],
                       by_key: dict[str, Need]) -> str | None:
    """``missing`` from the remote, each hashed on arrival; what failed first, or None."""
    for key in missing:
        n = by_key[key]
        try:
            if ctx.remote is None:
                raise KeyNotFound(f"{key}: not intact on the local or replica tier and there "
                                  "is no remote tier")
            if REMOTE in rec.tried.get(key, ()):
                raise ChecksumMismatch(f"{key}: the remote tier's copy", n.xxh64 or "?",
                                       "a copy that did not verify before")
            blob = await ctx.remote.get(key)
            if not intact(blob, n):
                rec.damaged(key, REMOTE)
                raise ChecksumMismatch(f"{key} on the remote tier", n.xxh64 or "?",
                                       xxhash.xxh64_hexdigest(blob))
            rec.data[key], rec.sources[key] = blob, REMOTE
            rec.verified.add(key)
        except Exception as err:
            return (f"rank {ctx.rank}: {key} of {rec.vid} is intact on no tier "
                    f"({type(err).__name__}: {err})")
    return None


async def _get_or_none(store: Store, key: str) -> bytes | None:
    try:
        return await store.get(key)
    except (KeyNotFound, FileNotFoundError):
        return None
