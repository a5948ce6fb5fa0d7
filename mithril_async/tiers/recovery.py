"""Which version a recovery restores, decided alike on every rank, and its manifest.

The ranks pool which versions their node and replica folders hold, and rank 0 which version
folders the remote has (one LIST with a delimiter, run while the local folders are listed):
the :class:`Inventory`. ``latest`` is the newest version complete on the fast tiers (every
rank's files in its owner's node folder or at one of its replica holders) unless the remote
holds a newer folder: a version is uploaded only after every node committed it locally, so that
happens only when fast tiers were lost or replaced, and only then does rank 0 ask for those
manifests (HEADs, newest first).

A version saved by another world size (a job back smaller after a node loss) follows the
saving job's replica mapping, not this one's: every rank announces which of the version's files
its node and replica folders hold (:class:`Held`, one gather), and ``latest`` is the newest
version whose every file each rank's restore reads some rank holds, else complete on the remote
(:func:`_elastic_latest`).

Every manifest, from whichever tier, passes the restore reader's checks
(:mod:`~mithril_async.tiers.manifests`) before a file it names is fetched; a copy that fails
them is skipped like a missing one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass

from mithril_async.errors import (
    DistributedError,
    InvalidFormat,
    KeyNotFound,
    StorageError,
    VersionNotFound,
)
from mithril_async.manifest import VersionManifest, version_number
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.files import Need, every_file
from mithril_async.tiers.manifests import confined_manifest, read_confined
from mithril_async.tiers.sources import Place
from mithril_async.tiers.transport import Payload

log = logging.getLogger("mithril_async")

#: the files this rank's restore of a version reads (``files.files_to_restore``)
FilesOf = Callable[[VersionManifest], list[Need]]


@dataclass(frozen=True)
class Held:
    """What one rank's node folder and replica folder hold: complete versions (in its
    :class:`Inventory`), or the files of one version (a version of another world size)."""

    local: Collection[str]
    replica: Collection[str]

    def of(self, place: Place) -> Collection[str]:
        return self.replica if place is Place.REPLICA else self.local


@dataclass(frozen=True)
class Inventory(Held):
    """The versions one rank's tiers hold: complete in its node and replica folders, and (rank
    0 only) the version folders on the remote, complete or not."""

    remote: Collection[str]


@dataclass(frozen=True)
class Chosen:
    """The version a recovery restores: its manifest and bytes, every rank's inventory, the
    files each rank holds (a version of another world size only), and the highest version
    number any tier showed (the floor of the next save's number)."""

    vid: str
    manifest: VersionManifest
    mdata: bytes
    inv: list[Inventory]
    held: list[Held] | None
    top: int


async def choose(ctx: TierContext, target: str, files: FilesOf) -> Chosen:
    """Collective: the version to restore (``"latest"``, or a version id) and its manifest;
    :class:`VersionNotFound` on every rank when no tier holds it complete."""
    inv = await _inventory(ctx)
    every = sorted({v for i in inv for v in (*i.local, *i.replica, *i.remote)})
    top = version_number(every[-1]) if every else 0
    held: list[Held] | None = None
    if target != "latest":
        if target not in every:
            raise VersionNotFound(f"run {ctx.run.run_id}: {target!r} is on no tier (with "
                                  "tiers, restore takes 'latest' or a version id)")
        got = await _try_manifest(ctx, target, strict=True)
        assert got is not None
        vid = target
    else:
        vid, got, held = await _latest(ctx, inv, every, files)
    m, mdata = got
    if m.world_size != ctx.world and held is None:
        held = await _held(ctx, m)
    return Chosen(vid, m, mdata, inv, held, top)


async def _inventory(ctx: TierContext) -> list[Inventory]:
    remote_list = (asyncio.ensure_future(ctx.folders(ctx.remote))
                   if ctx.rank == 0 and ctx.remote is not None else None)
    mine = Inventory(await ctx.versions(ctx.store.local), await ctx.versions(ctx.replica),
                     # version folders (one LIST, no GET); complete = its manifest (a HEAD)
                     await remote_list if remote_list is not None else [])
    inv: list[Inventory] = await ctx.gather(mine, "tiers: recovery inventory")
    return inv


def _fast(ctx: TierContext, inv: list[Inventory], v: str) -> bool:
    """Every rank's files of ``v`` are in its owner's node folder or at a replica holder."""
    return all(v in inv[r].local or any(v in inv[h].replica for h in ctx.holders(r))
               for r in range(ctx.world))


async def _latest(ctx: TierContext, inv: list[Inventory], every: list[str], files: FilesOf
                  ) -> tuple[str, tuple[VersionManifest, bytes], list[Held] | None]:
    fast_vs = [v for v in every if _fast(ctx, inv, v)]
    newest_fast = fast_vs[-1] if fast_vs else None
    newer = sorted((v for v in inv[0].remote if newest_fast is None or v > newest_fast),
                   reverse=True)
    found: str | None = None
    if newer:
        if ctx.rank == 0:
            assert ctx.remote is not None
            for v in newer:
                if await ctx.remote.exists(ctx.run.manifest_key(version_number(v))):
                    found = v
                    break
        found = (await ctx.gather(found, "tiers: newest remote version"))[0]
    vid = found or newest_fast
    got = None if vid is None else await _try_manifest(ctx, vid)
    held: list[Held] | None = None
    if got is None or got[0].world_size != ctx.world or got[0].held:
        # saved by another world size: the rule above follows the fixed replica mapping of
        # this job's nodes, not the saving job's; ask the holders instead (and a version
        # held for NaN/Inf is never "latest": the newest healthy one is)
        elastic = await _elastic_latest(ctx, inv, every, files)
        if elastic is not None:
            vid, got, held = elastic
        elif got is not None and got[0].held:
            got = None
    if vid is None or got is None:
        raise VersionNotFound(f"run {ctx.run.run_id}: no version is complete on any tier "
                              "(local, replicated, remote)")
    return vid, got, held


async def _elastic_latest(ctx: TierContext, inv: list[Inventory], every: list[str],
                          files: FilesOf
                          ) -> tuple[str, tuple[VersionManifest, bytes], list[Held] | None
                                     ] | None:
    """Collective: the newest version this job can restore, newest first: one of this world
    size counts as in :func:`_latest`; one of another world size if every file each rank's
    restore reads is in some rank's node or replica folder (:func:`_held`), or if its
    manifest is on the remote (written last, so every file is there). None if no version
    does. Why not the version-level rule alone: a node lost while a version was still being
    replicated leaves that version in the survivors' own folders but not every saved rank's
    files anywhere fast."""
    for v in sorted(every, reverse=True):
        got = await _try_manifest(ctx, v)
        if got is None or got[0].held:
            continue
        m = got[0]
        held: list[Held] | None = None
        if m.world_size == ctx.world:
            ok = _fast(ctx, inv, v)
        else:
            held = await _held(ctx, m)
            mine = all(any(n.key in h.local or n.key in h.replica for h in held)
                       for n in files(m))
            ok = all(await ctx.gather(mine, f"tiers: {v} held on the fast tiers"))
        if not ok and v in inv[0].remote:
            on_remote = False
            if ctx.rank == 0:
                assert ctx.remote is not None
                on_remote = await ctx.remote.exists(ctx.run.manifest_key(version_number(v)))
            ok = (await ctx.gather(on_remote, f"tiers: {v} complete on the remote"))[0]
        if ok:
            return v, got, held
    return None


async def _try_manifest(ctx: TierContext, vid: str, *, strict: bool = False
                        ) -> tuple[VersionManifest, bytes] | None:
    """Collective: :func:`_manifest`, or None on every rank when some rank found no readable
    manifest that stays inside the run on any tier (a version folder without its manifest:
    an upload or save that never finished; or a planted or damaged one). ``strict``, or any
    other error (a remote that fails): raised on every rank (that rank's own error; on the
    others a ``VersionNotFound`` or ``DistributedError`` naming the ranks)."""
    got: tuple[VersionManifest, bytes] | None = None
    error: Exception | None = None
    try:
        got = await _manifest(ctx, vid)
    except Exception as err:
        error = err
        log.warning("tiers: %s has no readable manifest on this rank's tiers (%s: %s)",
                    vid, type(err).__name__, err)
    kind = None if got is not None else (
        "missing" if isinstance(error, (VersionNotFound, KeyNotFound, InvalidFormat))
        else "error")
    kinds = await ctx.gather(kind, f"tiers: {vid} manifest")
    if all(k is None for k in kinds):
        return got
    if not strict and "error" not in kinds:
        return None
    if error is not None:
        raise error
    failed = [r for r, k in enumerate(kinds) if k is not None]
    if "error" in kinds:
        raise DistributedError(f"tiers: reading the manifest of {vid} failed on rank(s) "
                               f"{failed}")
    raise VersionNotFound(f"{vid}: rank(s) {failed} found no readable manifest of it on any "
                          "tier")


async def _manifest(ctx: TierContext, vid: str) -> tuple[VersionManifest, bytes]:
    """Collective: ``vid``'s manifest, from this node, else the lowest rank holding it, else
    the remote, each copy checked (module docstring; the remote's failure is raised: it is
    the last tier)."""
    mkey = ctx.run.manifest_key(version_number(vid))
    got: tuple[VersionManifest, bytes] | None = None
    for store in (ctx.store.local, ctx.replica):
        try:
            got = await read_confined(store, ctx.run, mkey)
        except (InvalidFormat, StorageError) as err:
            log.warning("rank %d: %s in %s is refused: %s", ctx.rank, mkey, store.url, err)
        if got is not None:
            break
    have = await ctx.gather(got is not None, "tiers: manifest needs")
    src = next((r for r, ok in enumerate(have) if ok), None)
    if src is not None and not all(have):
        sends: list[tuple[int, int, Payload]] = [
            (r, r + 1, got[1]) for r, ok in enumerate(have)
            if not ok and ctx.rank == src and got is not None]
        recvs = [(src, ctx.rank + 1)] if not have[ctx.rank] else []
        sent = await ctx.exchange(sends, recvs, f"recovery: manifest {mkey}")
        if recvs:
            data = bytes(sent.get(ctx.rank + 1, b""))
            try:
                got = (confined_manifest(ctx.run, mkey, data), data)
            except InvalidFormat as err:
                log.warning("rank %d: %s from rank %d is refused: %s", ctx.rank, mkey, src,
                            err)
    if got is None:
        got = None if ctx.remote is None else await read_confined(ctx.remote, ctx.run, mkey)
        if got is None:
            raise VersionNotFound(f"{mkey}: on no tier")
    return got


async def _held(ctx: TierContext, m: VersionManifest) -> list[Held]:
    """Collective, for a version saved by another world size: which of its files each rank's
    node and replica folder hold (present, of the manifest's size where it gives one)."""
    keys = sorted(every_file(m).items())
    folders = ((Place.NODE, ctx.store.local), (Place.REPLICA, ctx.replica))

    def scan() -> dict[Place, list[int]]:  # one thread for every stat (thousands of files)
        mine: dict[Place, list[int]] = {Place.NODE: [], Place.REPLICA: []}
        for place, store in folders:
            for i, (key, n) in enumerate(keys):
                try:
                    st = os.stat(store.local_path(key))
                except (OSError, StorageError, InvalidFormat):
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size > 0 and (
                        n.bytes is None or st.st_size == n.bytes):
                    mine[place].append(i)
        return mine

    mine = await asyncio.to_thread(scan)
    got = await ctx.gather(mine, "tiers: files held (reshard)")
    return [Held({keys[i][0] for i in d[Place.NODE]}, {keys[i][0] for i in d[Place.REPLICA]})
            for d in got]
