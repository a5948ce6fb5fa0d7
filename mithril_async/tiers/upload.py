"""Upload: each rank's files of a version to the remote; rank 0 publishes the manifest last.

Every object is written once (:func:`~mithril_async.tiers.write_once.put_once`): an object the
remote already holds under one of this version's keys with other bytes is left alone and fails
the upload with :class:`KeyExists` on every rank; the manifest is then not published and
``latest`` does not move. Once every rank's files are durable, rank 0 writes the manifest
(last: a version on the remote is complete when it is visible), moves ``latest`` and
``latest_remote`` there and applies the config's ``keep_*`` retention to the remote.
"""

from __future__ import annotations

from mithril_async.catalog import RunCatalog
from mithril_async.errors import DistributedError, KeyExists
from mithril_async.manifest import VersionManifest
from mithril_async.retention import apply_retention, from_config
from mithril_async.tiers.commit import VersionMeta
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.files import owned_files
from mithril_async.tiers.write_once import put_once

#: (the error's type name, what failed naming the rank)
_Failure = tuple[str, str]


async def upload(ctx: TierContext, meta: VersionMeta, m: VersionManifest,
                 configs_uploaded: set[str]) -> None:
    """Collective: ``m`` onto the remote (module docstring). ``configs_uploaded``: the run's
    config files this process already put there (rank 0 uploads each once)."""
    error: _Failure | None = None
    try:
        await _own_files(ctx, meta, m, configs_uploaded)
    except Exception as err:
        error = (type(err).__name__, f"rank {ctx.rank}: {type(err).__name__}: {err}")
    statuses = await ctx.gather(error, "tiers: upload status")
    bad = [s for s in statuses if s is not None]
    if not bad:
        published = await _publish(ctx, meta, m) if ctx.rank == 0 else None
        outcome = await ctx.gather(published, "tiers: remote commit")
        bad = [s for s in outcome if s is not None]
    if bad:
        msg = f"{m.version_id}: tier remote failed: {'; '.join(text for _, text in bad)}"
        if any(kind == KeyExists.__name__ for kind, _ in bad):
            raise KeyExists(msg)
        raise DistributedError(msg)


async def _own_files(ctx: TierContext, meta: VersionMeta, m: VersionManifest,
                     configs_uploaded: set[str]) -> None:
    assert ctx.remote is not None
    for need in owned_files(m).get(ctx.rank, []):
        await put_once(ctx.remote, need.key, await ctx.store.local.get(need.key), "remote")
    ckey = meta.config_key
    if ctx.rank == 0 and ckey is not None and meta.config is not None \
            and ckey not in configs_uploaded:
        await put_once(ctx.remote, ckey, meta.config, "remote")
        configs_uploaded.add(ckey)


async def _publish(ctx: TierContext, meta: VersionMeta, m: VersionManifest) -> _Failure | None:
    """Rank 0, once every rank's files are on the remote: the manifest, the aliases and the
    remote's retention; what failed, or None."""
    assert ctx.remote is not None
    try:
        await put_once(ctx.remote, meta.manifest_key, meta.manifest, "remote")
        cat = RunCatalog(ctx.remote, ctx.run)
        await cat.move_latest(m, meta.manifest_key)
        await cat.move_alias("latest_remote", m, meta.manifest_key)
        policy = from_config(ctx.cfg)
        if policy is not None:
            await apply_retention(cat, policy)
    except Exception as err:
        return type(err).__name__, f"rank 0: {type(err).__name__}: {err}"
    return None
