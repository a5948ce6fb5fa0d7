"""Rank 0's side of a save's version: the claim, the manifest commit, and what follows it.

The version number is claimed first (:meth:`VersionCommit.claim_version`), naming the committed
versions this save reads as delta bases or tensor holders, so that retention of another
process sharing the run (a second writer, ``mithril gc``) keeps them while the claim is live;
a heartbeat keeps the claim fresh while the save runs, so nobody takes it for abandoned.

The manifest is written iff every rank's part is good, the claim is still this save's (a
process that judged it abandoned removes the folder), every blob is present with its size, and
every base is still committed: :meth:`VersionCommit.commit`. Then the aliases, ``run.json``
and retention (:meth:`VersionCommit.after_commit`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import xxhash

from mithril_async.claims import Claim, heartbeat_interval
from mithril_async.errors import ClaimLost, KeyNotFound, MissingPrevious, NonFiniteState
from mithril_async.manifest import (
    BlobRef,
    OptimizerEntry,
    RankKey,
    ResumeInfo,
    RngEntry,
    SaveStats,
    ShardRef,
    VersionManifest,
    dump_model,
    utcnow,
    version_id,
    version_number,
)
from mithril_async.retention import apply_retention
from mithril_async.save.context import SaveContext
from mithril_async.save.coordinator import Outcome, RankPart
from mithril_async.save.nonfinite import blocking, describe, failure
from mithril_async.save.results import SaveResult
from mithril_async.save.xor_chain import depends_on
from mithril_async.storage.capabilities import sizes_under

__all__ = ["VersionCommit"]

log = logging.getLogger("mithril_async")


class VersionCommit:
    """One save's version at rank 0: its claim, kept alive while the save runs, and its
    commit. ``error``: the commit's own error, for the caller to raise as itself."""

    def __init__(self, ctx: SaveContext) -> None:
        self.ctx = ctx
        self.claim: Claim | None = None
        self.error: Exception | None = None
        self._heartbeat: asyncio.Future[None] | None = None

    async def claim_version(self, bases: set[str]) -> int:
        """Claim the next version number, naming the versions in ``bases`` as read by this
        save, and keep the claim's heartbeat going until :meth:`stop`."""
        ctx = self.ctx
        claim = await ctx.catalog.claim(bases)
        self.claim = claim
        interval = heartbeat_interval(ctx.config.checkpointing.pipeline.claim_stale_s)
        self._heartbeat = asyncio.ensure_future(ctx.catalog.keep_claim_alive(claim, interval))
        return claim.number

    def stop(self) -> None:
        """The save is over: the heartbeat stops."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()

    async def commit(self, number: int, res: SaveResult, parts: list[RankPart],
                     metrics: dict[str, Any]) -> tuple[Outcome, VersionManifest | None]:
        """Write the manifest iff every rank's blobs are durable (see module doc)."""
        bad = [p for p in parts if p.error is not None]
        if bad:
            return Outcome(committed=False, failed_rank=bad[0].rank,
                           error=f"rank {bad[0].rank} failed: {bad[0].error}"), None
        key = self.ctx.layout.manifest_key(number)
        mode = self.ctx.config.checkpointing.nonfinite
        try:
            manifest = await self._build_manifest(number, res, parts, metrics)
            blocked = blocking(manifest.blobs())  # every rank's NaN/Inf not allowed
            if blocked and mode == "fail":
                raise failure(res.step, blocked)
            if blocked and mode == "hold":
                manifest = manifest.model_copy(update={"held": True})
            await self._check_before_commit(manifest, parts)
            await self.ctx.store.put_if_absent(key, dump_model(manifest))
        except Exception as err:
            self.error = err
            if isinstance(err, MissingPrevious):  # a base is gone: the next save is a keyframe
                for chain in self.ctx.chains.values():
                    chain.reset()
                if self.ctx.lossy is not None:
                    self.ctx.lossy.reset()
            return Outcome(committed=False, failed_rank=0,
                           error=f"rank 0 could not commit {key}: {type(err).__name__}: {err}",
                           claim_lost=self.claim is not None and self.claim.lost,
                           nonfinite=err.tensors if isinstance(err, NonFiniteState) else {}
                           ), None
        if manifest.held:
            log.warning("%s (step %d) holds NaN/Inf (%s): it is committed, but latest and "
                        "best do not move to it (restore it by its id)", manifest.version_id,
                        manifest.step, describe(blocked))
        return Outcome(committed=True, manifest_key=key, nonfinite=blocked,
                       held=manifest.held), manifest

    async def _check_before_commit(self, manifest: VersionManifest,
                                   parts: list[RankPart]) -> None:
        """What another process sharing the run could have broken since the blobs were
        written: the claim must still be this save's, every blob present with its size, every
        base still committed. Raises :class:`ClaimLost` / :class:`MissingPrevious`; nothing
        is published then."""
        ctx, claim = self.ctx, self.claim
        if claim is not None and (claim.lost or not await ctx.catalog.claim_is_own(claim)):
            claim.lost = True
            raise ClaimLost(f"{ctx.layout.claim_key(claim.number)}: the claim of "
                            f"{manifest.version_id} is no longer this process's "
                            f"({claim.reason or 'removed or replaced by another process'}); "
                            "nothing is published")
        sizes = {b.key: b.bytes for b in manifest.blobs()}
        sizes |= {p.rng_key: p.rng_bytes for p in parts
                  if p.rng_key is not None and p.rng_bytes is not None}
        # a store that lists sizes answers for the whole version folder in a few listings;
        # any other store, and any key outside the folder, is asked key by key
        folder = ctx.layout.version_dir(version_number(manifest.version_id)) + "/"
        listed = await sizes_under(ctx.store, folder)
        found: dict[str, int | None] = dict(listed or {})
        asked = [k for k in sizes if listed is None or not k.startswith(folder)]
        found.update(zip(asked, await asyncio.gather(*(self._size(k) for k in asked)),
                         strict=True))
        for key, expected in sizes.items():
            size = found.get(key)
            if size is None:
                raise ClaimLost(f"{key} of {manifest.version_id} was removed before its commit "
                                "(by another process); nothing is published")
            if size != expected:
                raise ClaimLost(f"{key} of {manifest.version_id} has {size} bytes, "
                                f"{expected} were written; nothing is published")
        gone = await ctx.catalog.missing_bases(depends_on(manifest.blobs()))
        if gone:
            names = ", ".join(sorted(f"{b.version_id} ({b.key})" for b in gone))
            raise MissingPrevious(f"{manifest.version_id} needs {names}, deleted by another "
                                  "process before the commit; nothing is published and the "
                                  "next save is a keyframe")

    async def _size(self, key: str) -> int | None:
        """``key``'s size, None when it is gone."""
        try:
            return await self.ctx.store.size(key)
        except KeyNotFound:
            return None

    async def _build_manifest(self, number: int, res: SaveResult, parts: list[RankPart],
                              metrics: dict[str, Any]) -> VersionManifest:
        ctx = self.ctx
        model = parts[0].model
        if model is None:  # a sharded model: rank 0's shard stands for the model entry
            model = parts[0].shards.get("model")  # (none: the state has no model entry)
        shards: dict[str, list[ShardRef]] = {}
        for p in parts:
            for name, ref in p.shards.items():
                shards.setdefault(name, []).append(ref)
        optimizer = None
        if "optimizer" in shards:
            optimizer = OptimizerEntry(sharding="per_rank", shards=shards.pop("optimizer"))
        lossy = None
        if parts[0].lossy is not None:
            lossy = parts[0].lossy.model_copy(update={"shards": [
                s for p in parts if p.lossy is not None for s in p.lossy.shards]})
        quantized = lossy is not None and bool(lossy.quantized)
        exact = all(p.exact for p in parts) and not quantized
        return VersionManifest(
            run_id=ctx.layout.run_id, version_id=version_id(number), created_at=utcnow(),
            step=res.step, world_size=ctx.world_size,
            paths={"root_local": ctx.root_local(), "root_remote": ctx.root_remote()},
            config=await self._config_ref(), optimizer=optimizer,
            model=None if model is None else BlobRef(**model.model_dump(exclude={"rank"})),
            rng=RngEntry(per_rank=True, keys=[RankKey(rank=p.rank, key=p.rng_key or "",
                                                      xxh64=p.rng_xxh64) for p in parts]),
            extra=shards, resume=ResumeInfo(base_step=res.step, exact=exact),
            metrics=metrics, compression=ctx.encoder.describe(),
            stats=SaveStats(stall_s=res.stall_s, bytes_in=sum(p.bytes_in for p in parts),
                            bytes_out=sum(p.bytes_out for p in parts)),
            has_quantization=quantized, lossy=lossy,
            layouts={lid: lay for p in parts for lid, lay in p.layouts.items()},
        )

    async def _config_ref(self) -> BlobRef:
        """Write config/train.toml and config.json once per run; return the TOML's ref.

        Only what :func:`~mithril_async.config.recorded_config` keeps is written ([checkpointing]
        and the tables ``record_config`` names, secrets redacted), privately (0600 on disk):
        runs are copied and shared, training TOMLs hold API keys. Read back (and remembered)
        rather than hashed from our own bytes: another process of the run may have written it
        first, and the manifest must describe the file as it is."""
        from mithril_async.config import recorded_config
        from mithril_async.storage.base import put_private

        ctx = self.ctx
        if ctx.config_ref is not None:
            return ctx.config_ref
        key = ctx.layout.config_key("train.toml")
        if not await ctx.store.exists(key):
            toml_bytes, json_bytes = recorded_config(ctx.config)
            await put_private(ctx.store, key, toml_bytes)
            await put_private(ctx.store, ctx.layout.config_key("config.json"), json_bytes)
        data = await ctx.store.get(key)
        ctx.config_ref = BlobRef(key=key, bytes=len(data), xxh64=xxhash.xxh64_hexdigest(data),
                                 format="toml")
        return ctx.config_ref

    async def after_commit(self, manifest: VersionManifest, key: str) -> None:
        """After the manifest is durable: aliases, run manifest, retention."""
        ctx = self.ctx
        cfg = ctx.config.checkpointing
        ctx.catalog.remember(key, manifest)  # listed below: not read back and parsed again
        await ctx.catalog.move_latest(manifest, key)
        await ctx.catalog.move_best(manifest, key, cfg.best_metric_name, cfg.best_mode)
        # one listing serves run.json and retention (the run is listed once more at claim)
        versions = await ctx.catalog.versions(skip_damaged=True)
        await ctx.catalog.update_run_manifest(ctx.root_local(), ctx.root_remote(),
                                              versions=versions)
        if ctx.retention is None:
            return
        try:
            deleted = await apply_retention(ctx.catalog, ctx.retention, versions=versions)
            if ctx.steps is not None:
                ctx.steps.difference_update(v.step for v in deleted)
            if deleted:
                gone = {v.version_id for v in deleted}
                await ctx.catalog.update_run_manifest(
                    ctx.root_local(), ctx.root_remote(),
                    versions=[v for v in versions if v.version_id not in gone])
        except Exception as err:  # the version is committed; leftovers are cleaned at start
            log.warning("retention after %s failed (will retry after the next save): %r",
                        manifest.version_id, err)
