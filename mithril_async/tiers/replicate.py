"""Replication: each rank's files of a version to the ranks holding its replicas.

Each rank sends the encoded files it wrote (already compressed, mapped from the page cache) to
its replica holders (:mod:`~mithril_async.tiers.topology`); a holder checks every copy's size
and XXH64 against the manifest and keeps it under ``<local>/replica/``, then the manifest, and
moves ``latest_replicated`` once every rank's copy arrived. All messages of the version go in
one exchange (:meth:`~mithril_async.tiers.transport.GlooLink.exchange`), tagged alike on every
rank.

A file that cannot be read (EIO, gone) fails that file only: its owner sends an empty message
in its place, so the exchange still completes on both sides (a rank that skipped it would leave
its peers waiting until the deadline and the tier group broken for every later version). The
holder learns the file is missing, keeps the copies that did arrive, and every rank reports the
version's replication failed, naming each file; the next version replicates as usual.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import stat

import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.errors import ChecksumMismatch, DistributedError, StorageError
from mithril_async.manifest import VersionManifest
from mithril_async.storage.local import LocalStore
from mithril_async.tiers.commit import VersionMeta, write_meta
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.files import Need, intact, owned_files
from mithril_async.tiers.transport import Payload


async def replicate(ctx: TierContext, meta: VersionMeta, m: VersionManifest) -> None:
    """Collective: every rank's files of ``m`` to its holders (module docstring);
    :class:`DistributedError` on every rank, naming each problem, if any copy failed."""
    owned = owned_files(m)
    problems: list[str] = []
    mine: dict[str, Payload] = {}
    for need in owned.get(ctx.rank, []):
        try:
            mine[need.key] = (await mapped(ctx.store.local, need.key)
                              or await ctx.store.local.get(need.key))
        except Exception as err:
            mine[need.key] = b""
            problems.append(f"cannot read {need.key} ({type(err).__name__}: {err})")
    sends: list[tuple[int, int, Payload]] = []
    recvs: list[tuple[int, int]] = []
    meta_of: dict[int, tuple[int, Need]] = {}
    tag = 0
    for r in range(ctx.world):  # tags numbered the same way on every rank
        for h in ctx.holders(r):
            for need in owned.get(r, []):
                tag += 1
                if r == ctx.rank:
                    sends.append((h, tag, mine[need.key]))
                elif h == ctx.rank:
                    recvs.append((r, tag))
                    meta_of[tag] = (r, need)
    mine.clear()
    try:
        peers = sorted({h for h, _, _ in sends} | {r for r, _ in recvs})
        got = await ctx.exchange(sends, recvs, f"{m.version_id}: copies to/from rank(s) "
                                               f"{peers} (tier replicated)")
        sends.clear()
        problems += await _keep(ctx, got, meta_of)
    except Exception as err:
        problems.append(f"{type(err).__name__}: {err}")
    held_any = bool(recvs)
    if held_any and not problems:
        try:
            await write_meta(ctx.replica, meta, "replicated")
        except Exception as err:
            problems.append(f"{type(err).__name__}: {err}")
    error = f"rank {ctx.rank}: {'; '.join(problems)}" if problems else None
    statuses = await ctx.gather(error, "tiers: replication status")
    bad = [s for s in statuses if s is not None]
    if bad:
        raise DistributedError(f"{m.version_id}: tier replicated failed: {'; '.join(bad)}")
    if held_any:
        await RunCatalog(ctx.replica, ctx.run).move_alias("latest_replicated", m,
                                                          meta.manifest_key)


async def _keep(ctx: TierContext, got: dict[int, bytes | memoryview],
                meta_of: dict[int, tuple[int, Need]]) -> list[str]:
    """The copies that arrived intact, into the replica folder; what was wrong with the
    others."""
    problems = []
    for t, data in got.items():
        r, need = meta_of[t]
        if not data:
            problems.append(f"{need.key} from rank {r} is missing (its owner could not "
                            "send it)")
        elif not intact(data, need):
            problems.append(str(ChecksumMismatch(f"replica of {need.key} from rank {r}",
                                                 need.xxh64 or "?",
                                                 xxhash.xxh64_hexdigest(data))))
        else:
            await ctx.replica.put(need.key, data)
    return problems


async def mapped(store: LocalStore, key: str) -> Payload:
    """``key``'s file mapped read-only, to send from the page cache without reading it into a
    buffer first; ``b""`` when it is missing or empty. The tier layer's files are only ever
    replaced (written aside, renamed), never truncated in place, so the map stays valid while
    gloo reads it."""

    def open_map() -> Payload:
        try:
            fd = os.open(store.local_path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return b""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size == 0:
                return b""
            return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    try:
        return await asyncio.to_thread(open_map)
    except (OSError, ValueError, StorageError):
        return b""
