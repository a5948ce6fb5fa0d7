"""Version numbers that no tier already holds: the floor and rank 0's claim above it.

A version number names one version on every tier. Rank 0 claims numbers in its own node folder,
which need not hold the newest version another node's folder, a replica folder or the remote
holds: a fresh node folder with a fixed ``run_id``, or a recovery that took an older version
because the newest had not reached the replicas when a node died. Reusing such a number would
put a second version under a name another tier holds. So when the manager is made, and at
every recovery, the ranks pool the highest version folder any of their tiers holds
(:func:`top_number`, complete or not), and rank 0 claims above it (:func:`claim_above`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from mithril_async.catalog import RunCatalog
from mithril_async.errors import KeyExists, StorageError
from mithril_async.layout import RunLayout
from mithril_async.manifest import version_number
from mithril_async.storage.base import Store
from mithril_async.tiers.context import TierContext, version_folders


async def top_number(ctx: TierContext) -> int:
    """Collective: the highest version number whose folder any rank's node or replica folder,
    or the remote, holds (0: none). A failure to list anywhere fails on every rank: the next
    save could not be numbered safely."""
    mine: list[str] = []
    error: str | None = None
    try:
        mine = await ctx.folders(ctx.store) + await ctx.folders(ctx.replica)
        if ctx.rank == 0 and ctx.remote is not None:
            mine += await ctx.folders(ctx.remote)
    except Exception as err:
        error = f"rank {ctx.rank}: {type(err).__name__}: {err}"
    top = max((version_number(v) for v in mine), default=0)
    got = await ctx.gather((top, error), "tiers: version numbers on every tier")
    bad = [e for _, e in got if e is not None]
    if bad:
        raise StorageError(f"tiers: cannot tell which version numbers the tiers hold, so "
                           f"the next save cannot be numbered safely: {bad[0]}")
    return max(t for t, _ in got)


async def claim_above(store: Store, run: RunLayout, floor: int,
                      claim: Callable[[], Awaitable[int]]) -> int:
    """Rank 0's version claim in its node folder ``store``, above ``floor``: while the folder
    holds no folder that high, a claim of ``floor``'s number is held during the save's claim
    (so the claim goes above it) and dropped after."""
    n = floor
    held: bytes | None = None
    mine = [version_number(v) for v in await version_folders(store, run)]
    if max(mine, default=0) < n:
        with contextlib.suppress(KeyExists):
            held = await RunCatalog(store, run).claim_number(n)
    try:
        return int(await claim())
    finally:
        if held is not None:
            key = run.claim_key(n)
            with contextlib.suppress(Exception):
                if await store.get(key) == held:
                    await store.delete(key)
