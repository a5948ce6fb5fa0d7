"""A recovery's steps around the manager's restore: gather, repair, write into the node folder.

:func:`recover` chooses the version (:mod:`~mithril_async.tiers.recovery`) and gets every file
this rank's restore reads onto the node (:mod:`~mithril_async.tiers.fetch`). Nothing is written
into the node folder before every file is at hand; then the small files and the manifest (last)
are (:func:`settle`): the reader resolves the version there, and the next save reads the run's
config file there. The larger copies are served to the reader from memory (the node store's
overlay). If a rank's restore fails, every rank joins a :func:`repair` round: the failed rank
hashes each copy it used, a damaged one falls through to the next place for that file only
(hashed on arrival), and it restores again. After a successful restore the fetched copies are
written back into the node folder, durably, in the background (:func:`write_back`: each one
not hashed yet is hashed whole first, so the folder only ever gets intact copies). A restore
that fails in the end takes out of the node folder what the recovery wrote (:func:`undo`): the
folder is left as the recovery found it, never with a manifest whose files are missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from mithril_async.errors import KeyExists
from mithril_async.manifest import version_number
from mithril_async.storage.local import LocalStore
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.fetch import Recovery, fetch, from_node_folder
from mithril_async.tiers.files import intact
from mithril_async.tiers.recovery import FilesOf, choose
from mithril_async.tiers.sources import OWN_FOLDER

log = logging.getLogger("mithril_async")


async def recover(ctx: TierContext, target: str, files: FilesOf, *, light: bool
                  ) -> tuple[Recovery, int]:
    """Collective: choose the version and get every file this rank needs onto this node;
    the recovery and the highest version number any tier showed. ``light``: see
    :mod:`~mithril_async.tiers.fetch` (the small files are written here); else every copy
    is hashed and nothing is written yet."""
    t0 = time.perf_counter()
    chosen = await choose(ctx, target, files)
    rec = Recovery.of(chosen, files(chosen.manifest), t0, {})
    rec.mark("inventory")
    config_key = None if rec.manifest.config is None else rec.manifest.config.key
    for n in rec.needs:  # this node's folder: its own tier, then the copies it holds
        await from_node_folder(ctx, rec, n, light and n.key != config_key)
    rec.mark("own folder")
    await fetch(ctx, rec, [n.key for n in rec.needs if n.key not in rec.sources],
                verify=not light)
    if light:  # small files on disk now: the next save reads the run's config file
        await settle(ctx, rec, [k for k, d in rec.data.items() if len(d) <= rec.small],
                     ctx.store.local)
        rec.mark("small files written")
    return rec, chosen.top


async def settle(ctx: TierContext, rec: Recovery, keys: list[str], store: LocalStore) -> None:
    """Once every file this rank needs is at hand: ``keys`` written into the node folder
    (``store``), then the version's manifest. A failed write takes back what this recovery
    wrote."""
    try:
        await write(ctx, rec, keys, store)
        mkey = ctx.run.manifest_key(version_number(rec.vid))
        if not await ctx.store.local.exists(mkey):
            with contextlib.suppress(KeyExists):
                await ctx.store.local.put_if_absent(mkey, rec.mdata)
                rec.manifest_created = True
    except BaseException:
        await undo(ctx, rec)
        raise


async def write(ctx: TierContext, rec: Recovery, keys: list[str], store: LocalStore) -> None:
    """Copies of ``keys`` into ``store`` (the node folder), now; the ones it did not hold
    before are remembered (:func:`undo`)."""
    for key in keys:
        data = rec.data.get(key)
        if data is None:  # a copy in this node's replica folder
            data = await ctx.replica.get(key)
        if not await store.exists(key):
            rec.created.append(key)
        await store.put(key, data)
        rec.written.add(key)


async def undo(ctx: TierContext, rec: Recovery) -> None:
    """Take out of the node folder what this recovery put there (the manifest first, as
    every deletion of a version): for a recovery or restore that failed."""
    keys = ([ctx.run.manifest_key(version_number(rec.vid))]
            if rec.manifest_created else []) + rec.created
    for key in keys:
        try:
            await ctx.store.local.delete(key)
        except Exception as err:
            log.warning("rank %d: could not take %s (written by a failed recovery of %s) "
                        "out of %s: %r", ctx.rank, key, rec.vid, ctx.root, err)
    rec.manifest_created = False
    rec.created.clear()


async def repair(ctx: TierContext, rec: Recovery, mine: bool, round_: int) -> bool:
    """Collective, after a restore failed on some rank. A failed rank (``mine``) hashes every
    copy it used that nothing has hashed yet; a damaged one falls through to the next place
    for that file only (this node's folders, then peers and the remote, now hashing on
    arrival). True if this rank replaced a copy (so restoring again can succeed)."""
    missing: list[str] = []
    damaged = 0
    if mine:
        for n in rec.needs:
            if n.key in rec.verified:
                continue
            src = rec.sources[n.key]
            copy = rec.data.get(n.key)
            if copy is None:
                store = ctx.store.local if src == OWN_FOLDER else ctx.replica
                with contextlib.suppress(FileNotFoundError):
                    copy = await store.get(n.key)
            if intact(copy, n):
                rec.verified.add(n.key)
                continue
            log.warning("%s: the copy from %s does not verify; trying the next tier",
                        n.key, src)
            damaged += 1
            rec.damaged(n.key, src)
            del rec.sources[n.key]
            rec.data.pop(n.key, None)
            rec.written.discard(n.key)
            await from_node_folder(ctx, rec, n, light=False)
            if n.key not in rec.sources:
                missing.append(n.key)
    await fetch(ctx, rec, missing, verify=True)
    await write(ctx, rec, [k for k in missing if k in rec.data and len(rec.data[k]) <= rec.small],
                ctx.store.local)
    rec.mark(f"repair {round_}")
    return damaged > 0


async def write_back(ctx: TierContext, rec: Recovery) -> None:
    """After a restore, in the background: the copies it used from elsewhere, durably into
    the node folder, so that this node's tier holds the version again (a later recovery, or
    a peer's, finds it here). Each copy not hashed yet is hashed whole first (the reader
    verified what it read, which need not be every byte of a file). A failure only logs: the
    copy is fetched again next time."""
    needs = {n.key: n for n in rec.needs}
    try:
        for key in [k for k in rec.fetched() if k not in rec.written]:
            data = rec.data.get(key)
            copy = data if data is not None else await ctx.replica.get(key)
            if key not in rec.verified and key in needs and \
                    not await asyncio.to_thread(intact, copy, needs[key]):
                log.warning("rank %d: %s from %s does not verify whole; not written back",
                            ctx.rank, key, rec.sources.get(key))
                continue
            await ctx.store.local.put(key, copy)
        rec.mark("written back (background)")
    except Exception as err:
        log.warning("rank %d: writing the recovered copies of %s back into %s failed: %r",
                    ctx.rank, rec.vid, ctx.root, err)
