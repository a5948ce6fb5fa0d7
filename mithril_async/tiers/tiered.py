"""The tier layer: commit on node-local storage, replicate to a peer node, trickle to the remote.

How it plugs into a save without changing the save protocol (:mod:`mithril_async.pipeline.save`):

- The manager's store is this process's node-local tier, a :class:`NodeStore` (a LocalStore
  under ``tiers.local``). Every rank writes its blobs there, durably, exactly as before.
- The manager's coordinator is a :class:`TierCoordinator` wrapped around the usual one. Rank 0's
  commit checks every blob's size in its store; blobs of ranks on other nodes are not in rank
  0's node folder, so their sizes come from what those ranks reported durable in this save's
  gather (``NodeStore.reported``, cleared after the verdict). After a committed verdict, rank 0
  broadcasts the manifest (and the run's config file) on the save protocol's own group, and
  the lowest rank of every node writes them into its node folder and moves ``latest_local``
  there: the version is committed on the local tier of every node before ``save()``'s handle
  resolves.
- Replication and upload then run in the background on the tier layer's own loop and gloo
  group (:mod:`mithril_async.tiers.transport`), one version after the other and in the same
  order on every rank: each rank sends the encoded blobs it wrote (already compressed) to its
  replica holders (:mod:`mithril_async.tiers.topology`), who keep them under
  ``<local>/replica/`` with the manifest and move ``latest_replicated`` once every rank's copy
  arrived; then each rank uploads its blobs to the remote and rank 0, once all uploads are
  durable, writes the manifest there (last, so a remote version is complete when visible) and
  moves ``latest_remote`` and ``latest``. :class:`TierResult` says which tiers each version
  reached and when; a tier that failed is named with the rank in ``errors``. A file one rank
  cannot read fails that version's replication for that file only: an empty message goes in
  its place, so the exchange completes and the holder knows the file is missing.
- A version's objects are written once on every tier (:mod:`mithril_async.tiers.write_once`):
  an object the remote already holds under one of its keys with other bytes is left alone and
  fails that upload with ``KeyExists``. And the numbers cannot collide to begin with: when the
  manager is made, rank 0 learns the highest version folder any rank's node or replica
  folder, or the remote, holds (:attr:`Tiers.floor`) and numbers its saves above it, so a
  job on a new node folder with a fixed ``run_id`` never reuses v000001.
- Retention per tier: the node lead keeps ``keep_local`` versions in its node folder and
  ``keep_replicated`` in its replica folder; the remote follows the config's ``keep_*`` policy.
  The newest version complete on the remote is never deleted from a fast tier while no newer
  version is complete anywhere, and no version is deleted from the node folder before its
  replication and upload ran (they copy it from there).

Recovery (:meth:`Tiers.restore`): the ranks pool which versions their node and replica
folders hold, and rank 0 which version folders the remote has (one LIST with a delimiter, run
while the local folders are listed). The newest version complete on the fast tiers is taken
unless the remote holds a newer folder: a version is uploaded only after every node committed
it locally, so that happens only when fast tiers were lost or replaced, and only then does
rank 0 ask for those manifests (HEADs). Each rank then finds the files it needs (its own
shards and RNG file, the model): in its node folder (its own tier, then the copies the node
holds), else at the ranks holding a copy (over the tier group; the next holder when one
copy is damaged or missing), else on the remote. Every manifest, from whichever tier, passes
the restore reader's checks (:mod:`mithril_async.tiers.manifests`) before a file it names is
fetched. A file in the node's folders is checked by size and a peer's copy by size; the
manager's one reader then verifies what it restores as it does for any restore
(``[checkpointing.restore] verify``: every block's hash, or the manifest's whole-blob
XXH64), reading the fetched
copies from memory (:attr:`NodeStore.overlay`), not from a copy written to disk first. If a
rank's restore fails, every rank joins a repair round: the failed rank hashes each copy it
used, a damaged one falls through to the next tier for that file only (hashed on arrival),
and it restores again (overwriting whatever the failed attempt wrote). Copies from the remote
are hashed on arrival. Fetched copies are written back into the node folder, durably, in the
background after the restore (hashed whole first if nothing had hashed them whole); the next
save's tier work, :meth:`Tiers.wait` and :meth:`Tiers.close` wait for that. Nothing is written
into the node folder before every file is at hand (the manifest last), and a restore that
fails takes out what the recovery wrote: a failed recovery leaves the node folder as it found
it, not with a manifest whose files are missing.
:meth:`Tiers.recover` is the strict form: every file hashed and written into the node folder
before it returns.

A version saved by another world size (a job back smaller after a node loss) composes with
the reader's resharding (:mod:`mithril_async.restore.reshard`): each rank's files are what
the reader will read for it (:func:`restore_files`):
the blobs of the saved ranks whose pieces overlap the boxes it will hold (``plan_reads`` on
the manager's reshard targets), the lowest saved rank's (skeleton, replicated pieces), every
saved rank's RNG file, the whole model unless sharded; every saved blob of an item whose plan
cannot be made here. The fixed replica mapping is that of the saving job's nodes, so instead
every rank announces which of the version's files its node and replica folders hold
(:meth:`Tiers._held`, one gather) and a holder sends; else the remote. ``latest`` is the
newest version whose every such file some rank holds, else complete on the remote
(:meth:`Tiers._elastic_latest`). The reader then reshards from the node folder and the
overlay. The node map is always the running job's, so the next save replicates and keeps
versions by the new nodes; rank 0 numbers it above every version any rank's tiers showed
(:meth:`Tiers.claim_above_floor`), whatever version the recovery took.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import mmap
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.config import CheckpointingConfig, Config
from mithril_async.distributed import DistCoordinator, dist_world
from mithril_async.errors import (
    ChecksumMismatch,
    ConfigError,
    DistributedError,
    InvalidFormat,
    KeyExists,
    KeyNotFound,
    PreconditionFailed,
    StorageError,
    VersionNotFound,
)
from mithril_async.layout import RunLayout, new_run_id
from mithril_async.manifest import (
    AliasFile,
    PieceMeta,
    ShardRef,
    VersionManifest,
    dump_model,
    parse_model,
    utcnow,
    version_id,
    version_number,
)
from mithril_async.pipeline.coordinator import Coordinator, LocalCoordinator, Outcome, RankPart
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.restore.reshard import Box, SavedPiece, plan_reads
from mithril_async.retention import apply_retention, from_config
from mithril_async.storage.base import Store, check_range
from mithril_async.storage.local import LocalStore
from mithril_async.tiers.config import TiersConfig, check_local_root
from mithril_async.tiers.manifests import confined_manifest, read_confined
from mithril_async.tiers.topology import NodeMap
from mithril_async.tiers.transport import GlooLink, Link, LocalLink, Payload
from mithril_async.tiers.write_once import put_once

log = logging.getLogger("mithril_async")

_RANK_IN_KEY = re.compile(r"_rank(\d{4})\.[^/]*$")
TIERS = ("local", "replicated", "remote")
#: files a recovery fetched that are at most this big are written into the node folder
#: before the restore (the next save reads the run's config file there; RNG files are tiny);
#: larger ones are served to the reader from memory and written back in the background
_SMALL = 1 << 20


class NodeStore(LocalStore):
    """The node-local tier. ``reported``: sizes of blobs other nodes' ranks reported durable in
    the save being committed (rank 0's commit check cannot see another node's disk).
    ``overlay``: during :meth:`Tiers.restore`, the files this node's folder lacks, served to
    the manager's reader from where the recovery found them: bytes a peer or the remote sent
    (in memory: not written to disk and read back before the restore), or the store of the
    node's replica folder. Only reads consult it."""

    def __init__(self, root: str | Path, **kw: Any) -> None:
        super().__init__(root, **kw)
        self.reported: dict[str, int] = {}
        self.overlay: dict[str, bytes | memoryview | Store] = {}

    async def get(self, key: str) -> bytes:
        src = self.overlay.get(key)
        if src is None:
            return await super().get(key)
        if isinstance(src, (bytes, memoryview)):
            return bytes(src)
        return await src.get(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        src = self.overlay.get(key)
        if src is None:
            return await super().get_range(key, start, length)
        if isinstance(src, (bytes, memoryview)):
            check_range(key, start, length)
            return bytes(src[start:start + length])
        return await src.get_range(key, start, length)

    async def size(self, key: str) -> int:
        src = self.overlay.get(key)
        if src is not None:
            return len(src) if isinstance(src, (bytes, memoryview)) else await src.size(key)
        try:
            return await super().size(key)
        except KeyNotFound:
            if key in self.reported:
                return self.reported[key]
            raise


@dataclass
class TierResult:
    """Which tiers one version reached, and when (seconds after its local commit)."""

    version_id: str
    step: int
    committed_at: float
    reached: dict[str, float] = field(default_factory=dict)
    #: tier -> what failed (naming the rank)
    errors: dict[str, str] = field(default_factory=dict)
    #: tier -> the error itself (typed: ``KeyExists`` when the remote already held another
    #: object under one of this version's keys, else ``DistributedError`` naming each rank's)
    failures: dict[str, BaseException] = field(default_factory=dict)
    done: concurrent.futures.Future[None] = field(
        default_factory=concurrent.futures.Future, repr=False)

    def wait(self, timeout: float | None = None) -> TierResult:
        """Block until the background tier work of this version ended (reached or failed)."""
        concurrent.futures.wait([self.done], timeout)
        return self


@dataclass(frozen=True)
class Need:
    """One file a rank needs to restore a version: its key, size and XXH64 when known."""

    key: str
    owner: int
    bytes: int | None
    xxh64: str | None


def owner_of(key: str) -> int:
    """The rank that wrote a blob (``..._rankNNNN.ext``; the whole model is rank 0's)."""
    m = _RANK_IN_KEY.search(key)
    return int(m.group(1)) if m else 0


def owned_files(m: VersionManifest) -> dict[int, list[Need]]:
    """Every file of a version by the rank that wrote it (blobs and RNG files)."""
    out: dict[int, list[Need]] = {}
    seen: set[str] = set()
    for b in m.blobs():
        if b.key in seen:
            continue
        seen.add(b.key)
        o = owner_of(b.key)
        out.setdefault(o, []).append(Need(b.key, o, b.bytes, b.xxh64))
    for k in m.rng.keys:
        out.setdefault(k.rank, []).append(Need(k.key, k.rank, None, k.xxh64))
    return out


def needed_files(m: VersionManifest, rank: int) -> list[Need]:
    """What the one reader reads for ``rank`` (same world size): the model (rank 0's whole
    model, or with a sharded model this rank's shard, listed with its shards), this rank's
    shards and RNG file; and the run's config file."""
    out = []
    if m.config is not None:  # the run's recorded config: the next save's manifest names it
        out.append(Need(m.config.key, 0, m.config.bytes, m.config.xxh64))
    if "model" not in m.extra:
        out.append(Need(m.model.key, owner_of(m.model.key), m.model.bytes, m.model.xxh64))
    out.extend(n for n in owned_files(m).get(rank, []) if n.key not in {o.key for o in out})
    return out


#: ``targets(item, saved pieces by tensor name)``: where this rank writes each tensor of a
#: sharded item (name -> an object with a ``box``), or None (the manager's
#: ``_reshard_targets``, the same callback its one reader asks)
Targets = Callable[[str, dict[str, PieceMeta]], Mapping[str, Any] | None]


def resharded_files(m: VersionManifest, targets: Targets | None) -> list[Need]:
    """What the one reader reads for a rank restoring ``m`` on another world size (a
    reshard, :mod:`mithril_async.restore.reshard`): the run's config file and the whole
    model (unless the model is sharded), for every sharded item the blobs of the saved ranks
    whose pieces overlap a box this rank will hold (:func:`plan_reads` on the boxes
    ``targets`` gives, as the reader plans them) and the lowest saved rank's (it supplies
    the item's skeleton), and every saved rank's RNG file (a reshard maps them all through
    ``on_reshard``). Conservative where the plan cannot be made here (no ``targets``, an
    item without pieces, a plan the reader will refuse): every saved rank's blob of that
    item, so the reader still sees what it needs and reports its own clear error."""
    out: list[Need] = []
    if m.config is not None:
        out.append(Need(m.config.key, 0, m.config.bytes, m.config.xxh64))
    if "model" not in m.extra:
        out.append(Need(m.model.key, owner_of(m.model.key), m.model.bytes, m.model.xxh64))
    for item, shards in _per_rank_items(m).items():
        refs = {s.rank: s for s in shards}
        for r in sorted(_saved_ranks_read(item, refs, targets)):
            out.append(Need(refs[r].key, r, refs[r].bytes, refs[r].xxh64))
    out.extend(Need(k.key, k.rank, None, k.xxh64) for k in m.rng.keys)
    return _unique(out)


def restore_files(m: VersionManifest, rank: int, world: int, targets: Targets | None
                  ) -> list[Need]:
    """What the one reader reads for ``rank`` of a job of ``world`` ranks restoring ``m``:
    :func:`resharded_files` on another world size; on the same one :func:`needed_files`,
    plus, for a sharded item restored from its pieces, the lowest saved rank's blob (it
    supplies the item's skeleton and the replicated pieces, such as step counters)."""
    if m.world_size != world:
        return resharded_files(m, targets)
    out = needed_files(m, rank)
    if targets is not None:
        for item, shards in _per_rank_items(m).items():
            if shards and all(s.pieces for s in shards):
                refs = {s.rank: s for s in shards}
                for r in sorted(_saved_ranks_read(item, refs, targets)):
                    out.append(Need(refs[r].key, r, refs[r].bytes, refs[r].xxh64))
    return _unique(out)


def _per_rank_items(m: VersionManifest) -> dict[str, list[ShardRef]]:
    items: dict[str, list[ShardRef]] = {}
    if m.optimizer is not None:
        items["optimizer"] = list(m.optimizer.shards)
    items.update({name: list(shards) for name, shards in m.extra.items()})
    return items


def _unique(needs: list[Need]) -> list[Need]:
    out: dict[str, Need] = {}
    for n in needs:
        out.setdefault(n.key, n)
    return list(out.values())


def _saved_ranks_read(item: str, refs: Mapping[int, ShardRef], targets: Targets | None
                      ) -> set[int]:
    """The saved ranks whose ``item`` blob a reshard reads on this rank (see
    :func:`resharded_files`); every saved rank when that cannot be worked out here."""
    every = set(refs)
    if targets is None or not refs:
        return every
    names = {frozenset(s.pieces) for s in refs.values()}
    if len(names) != 1 or not next(iter(names)):
        return every  # not reshardable: the reader refuses it with its own error
    try:
        tgts = targets(item, dict(refs[min(refs)].pieces))
        if tgts is None:
            return every
        out = {min(refs)}  # the skeleton
        for name, t in tgts.items():
            pieces = [SavedPiece(r, Box.of(p.offsets, p.lengths), p.replicated)
                      for r, ref in refs.items() if (p := ref.pieces.get(name)) is not None]
            out.update(rd.rank for rd in plan_reads(f"{item}/{name}", t.box, pieces))
        return out
    except Exception as err:  # the reader raises it again, clearly; fetch all meanwhile
        log.debug("tiers: no read plan for %s here (%r); fetching every saved rank's blob",
                  item, err)
        return every


def intact(data: bytes | memoryview | None, need: Need) -> bool:
    if data is None:
        return False
    if need.bytes is not None and len(data) != need.bytes:
        return False
    return need.xxh64 is None or xxhash.xxh64_hexdigest(data) == need.xxh64


def _part_sizes(p: RankPart) -> dict[str, int]:
    out: dict[str, int] = {}
    if p.model is not None:
        out[p.model.key] = p.model.bytes
    out.update({s.key: s.bytes for s in p.shards.values()})
    if p.lossy is not None:
        out.update({s.key: s.bytes for s in p.lossy.shards})
    if p.rng_key is not None and p.rng_bytes is not None:
        out[p.rng_key] = p.rng_bytes
    return out


async def move_alias(store: Store, layout: RunLayout, name: str, m: VersionManifest,
                     key: str) -> bool:
    """Point ``aliases/<name>.json`` in ``store`` at ``m`` unless it names a later version
    (compare-and-swap, like ``latest``)."""
    akey = layout.alias_key(name)
    for _ in range(16):
        try:
            data, etag = await store.get_with_etag(akey)
            cur = parse_model(AliasFile, data, akey)
        except KeyNotFound:
            cur, etag = None, None
        if cur is not None and cur.version_id is not None and cur.version_id >= m.version_id:
            return False
        new = AliasFile(name=name, status="ok", run_id=m.run_id, version_id=m.version_id,
                        step=m.step, manifest_key=key, updated_at=utcnow())
        try:
            await store.put_if_match(akey, dump_model(new), etag)
            return True
        except (PreconditionFailed, KeyExists):
            continue
    raise PreconditionFailed(f"alias {akey}: too much contention")


class TierCoordinator:
    """The manager's coordinator with the local-tier commit added after the verdict."""

    def __init__(self, inner: Coordinator, tiers: Tiers) -> None:
        self.inner = inner
        self.tiers = tiers
        self.rank = inner.rank
        self.world_size = inner.world_size

    async def agree_version(self, claim: Any) -> int:
        if self.rank == 0 and self.tiers.floor:
            return await self.inner.agree_version(lambda: self.tiers.claim_above_floor(claim))
        return await self.inner.agree_version(claim)

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        parts = await self.inner.gather_parts(part)
        if parts is not None:  # rank 0: other nodes' blobs are durable on their own disks
            reported: dict[str, int] = {}
            for p in parts:
                if p.error is None:
                    reported.update(_part_sizes(p))
            self.tiers.store.reported = reported
        return parts

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        try:
            out = await self.inner.broadcast_outcome(outcome)
        finally:
            self.tiers.store.reported = {}
        if not out.committed or out.manifest_key is None:
            return out
        payload: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                payload = await self.tiers.manifest_payload(out.manifest_key)
            except Exception as err:  # every rank must still leave the broadcast alike
                payload = {"error": f"rank 0 could not read {out.manifest_key} back: "
                                    f"{type(err).__name__}: {err}"}
        if isinstance(self.inner, DistCoordinator):
            payload = await self.inner._collective(
                "tier_manifest", self.inner._bcast_fn(payload))
        assert payload is not None
        if "error" in payload:
            raise StorageError(f"tier local: {payload['error']}")
        await self.tiers.commit_local(payload)
        return out

    def close(self) -> None:
        self.inner.close()


class Tiers:
    """The tiers of one process: node-local store, replica store, remote, and the peer link.

    Every rank constructs it at the same point (it creates a gloo group), with the same
    config. ``remote``: a store to use as the durable tier instead of opening
    ``[checkpointing.remote]`` (tests count its requests). Bad input fails here: a missing or
    unwritable local path, ``replicas`` >= nodes (:class:`ConfigError`), an unreachable remote
    (:class:`StorageError`)."""

    def __init__(self, config: Config | CheckpointingConfig,
                 tiers: TiersConfig | Mapping[str, Any] | None = None, *,
                 remote: Store | None = None, link: Link | None = None,
                 node_map: NodeMap | None = None) -> None:
        self.config = config if isinstance(config, Config) else Config(checkpointing=config)
        cfg = self.cfg = self.config.checkpointing
        if tiers is None:
            tiers = getattr(cfg, "tiers", None)
            if tiers is None:
                raise ConfigError("checkpointing.tiers is not set (local = ..., replicas = ...)")
        self.tcfg = tiers if isinstance(tiers, TiersConfig) else TiersConfig.from_mapping(tiers)
        comp = cfg.compression
        if comp.delta or comp.dedup or cfg.lossy.enabled:
            raise ConfigError("checkpointing.tiers: delta chains, dedup and the lossy tier are "
                              "not supported with tiers yet (compression.delta, "
                              "compression.dedup, lossy.enabled must be off)")
        world = dist_world()
        if link is None:
            link = (GlooLink(self.tcfg.commit_timeout_s) if world is not None and world[1] > 1
                    else LocalLink())
        self.link = link
        self.rank, self.world = link.rank, link.world_size
        if node_map is None:
            hosts = None
            if self.world > 1:
                hosts = link.all_gather(socket.gethostname(), "tiers: gather hostnames")
            node_map = NodeMap.from_env(self.world, hosts)
        self.nodes = node_map
        self.node = node_map.node_of[self.rank]
        self.holders = node_map.replica_holders(self.rank, self.tcfg.replicas)
        root = check_local_root(self.tcfg, self.node, self.rank)
        self.root = root
        self.per_rank_folder = "{rank}" in self.tcfg.local
        self.lead = self.per_rank_folder or node_map.is_lead(self.rank)
        self.store = NodeStore(root)
        self.replica_store = LocalStore(root / "replica")
        #: recovered copies written back into the node folder, without fsync: every read
        #: of them is verified against the manifest, so a copy torn by a power loss is only
        #: fetched again, and a restore does not wait for the disk
        self._hydrate = LocalStore(root, durable=False)
        self.runs_prefix = Path(cfg.runs_path).name or "runs"
        self._loop = BackgroundLoop(name="mithril-tiers")
        self.remote: Store | None = None
        if self.tcfg.upload and (remote is not None or cfg.remote is not None):
            try:
                if remote is None:
                    remote = self._loop.run(self._open(cfg))
                self.remote = remote
                self._loop.run(self._probe_remote(), timeout=self.tcfg.commit_timeout_s + 5)
            except BaseException:  # nothing of a Tiers that failed to start stays running
                if self.remote is not None:
                    with contextlib.suppress(Exception):
                        self._loop.run(self.remote.close())
                self._loop.close()
                raise
        self.layout: RunLayout | None = None
        #: the manager's reshard targets (where its one reader writes each sharded tensor):
        #: what a recovery onto another world size needs to plan its fetches
        self._targets: Targets | None = None
        self.results: dict[str, TierResult] = {}
        self._last: concurrent.futures.Future[None] | None = None
        #: newest versions this process saw complete on the remote / replica tier
        self._newest_remote: str | None = None
        self._newest_replicated: str | None = None
        #: versions committed on the node folder whose replication and upload have not run
        #: yet: retention leaves them there (they are copied from there)
        self._pending: set[str] = set()
        #: the run's config file once this process checked it is on the remote
        self._config_on_remote: str | None = None
        self._closed = False
        #: the newest version number any rank's tiers (node and replica folders, the
        #: remote) showed when the manager was made or at the last recovery: rank 0 numbers
        #: the next save above it (:meth:`claim_above_floor`)
        self.floor = 0
        #: after :meth:`recover`: where each file this rank needed came from
        self.last_sources: dict[str, str] = {}
        #: after :meth:`recover`: seconds from its start to the end of each phase
        self.last_timings: dict[str, float] = {}

    @staticmethod
    async def _open(cfg: CheckpointingConfig) -> Store:
        from mithril_async.storage import open_store

        return open_store(cfg.remote)

    async def _probe_remote(self) -> None:
        assert self.remote is not None
        where = getattr(self.remote, "url", None) or type(self.remote).__name__
        if self.cfg.remote is not None:
            r = self.cfg.remote
            where = f"s3://{r.bucket}/{r.prefix} at {r.endpoint_url or 'the default endpoint'}"
        try:
            await asyncio.wait_for(self.remote.list_dir(self.runs_prefix),
                                   self.tcfg.commit_timeout_s)
        except Exception as err:
            raise StorageError(f"checkpointing.remote: the remote tier {where} is unreachable "
                               f"at start ({type(err).__name__}: {err})") from err

    # ------------------------------------------------------------------ construction helpers
    def manager(self, state: Mapping[str, Any], **kw: Any) -> Any:
        """A CheckpointManager whose saves commit on this node's tier and then replicate and
        upload in the background. Every rank calls it at the same point (the ranks then
        pool the highest version number their tiers hold: :meth:`_top_number`)."""
        from mithril_async.manager import CheckpointManager

        inner: Coordinator = (DistCoordinator(timeout_s=self.tcfg.commit_timeout_s)
                              if self.world > 1 else LocalCoordinator())
        config = self.config
        if self.cfg.run_id is None:  # every rank must use rank 0's fresh run id
            rid = new_run_id()
            if isinstance(inner, DistCoordinator):
                rid = inner.broadcast_from_zero(rid, "tiers: agree run id")
            config = config.model_copy(deep=True)
            config.checkpointing.run_id = rid
        kw.setdefault("retention", None)  # per tier, here
        user_on_save = kw.pop("on_save", None)

        def on_save(res: Any) -> None:  # the save's own result names the tiers it reaches
            res.tiers = self.results.get(res.version_id)
            if user_on_save is not None:
                user_on_save(res)

        kw["on_save"] = on_save
        mgr = CheckpointManager(config, state, store=self.store, runs_prefix=self.runs_prefix,
                                coordinator=TierCoordinator(inner, self), **kw)
        self.layout = mgr.layout
        self._targets = getattr(mgr, "_reshard_targets", None)
        try:
            self.floor = max(self.floor, self._loop.run(self._top_number()))
        except BaseException:
            mgr.close()
            raise
        return mgr

    async def _top_number(self) -> int:
        """Collective: the highest version number whose folder any rank's node or replica
        folder, or the remote, holds (complete or not). Why before the first save: a job
        whose node folder is new (a fresh machine, a fixed ``run_id``) would otherwise
        number its first save v000001 and write it over the version of that name that
        another node or the remote already holds."""
        mine: list[str] = []
        error: str | None = None
        try:
            mine = await self._folders(self.store) + await self._folders(self.replica_store)
            if self.rank == 0 and self.remote is not None:
                mine += await self._folders(self.remote)
        except Exception as err:
            error = f"rank {self.rank}: {type(err).__name__}: {err}"
        top = max((version_number(v) for v in mine), default=0)
        got = await self._gloo(self.link.all_gather, (top, error),
                               "tiers: version numbers on every tier")
        bad = [e for _, e in got if e is not None]
        if bad:
            raise StorageError(f"tiers: cannot tell which version numbers the tiers hold, so "
                               f"the next save cannot be numbered safely: {bad[0]}")
        return max(t for t, _ in got)

    def close(self) -> None:
        """Wait for the background tier work, then release the loop, stores and group."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.wait()
        if self.remote is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self.remote.close())
        self._loop.close()
        self.link.close()

    # ------------------------------------------------------------------ save path
    async def manifest_payload(self, manifest_key: str) -> dict[str, Any]:
        """Rank 0, after the commit: what every node needs to commit the version locally."""
        assert self.layout is not None
        data = await self.store.get(manifest_key)
        m = parse_model(VersionManifest, data, manifest_key)
        conf = None if m.config is None else await _get_or_none(self.store, m.config.key)
        return {"manifest_key": manifest_key, "manifest": data,
                "config_key": None if conf is None or m.config is None else m.config.key,
                "config": conf}

    async def commit_local(self, payload: dict[str, Any]) -> None:
        """Every rank, after the verdict: the node lead writes the manifest into its node
        folder and moves ``latest_local``; then the background tier job is queued."""
        assert self.layout is not None
        key, data = payload["manifest_key"], payload["manifest"]
        m = parse_model(VersionManifest, data, key)
        # before the manifest lands here: retention must see it as still to be copied
        self._pending.add(m.version_id)
        if self.lead:
            await _write_meta(self.store, payload, "local")
            await move_alias(self.store, self.layout, "latest_local", m, key)
        res = TierResult(m.version_id, m.step, time.time())
        res.reached["local"] = 0.0
        self.results[m.version_id] = res
        prev = self._last
        self._last = fut = self._loop.submit(self._background(payload, m, res, prev))
        fut.add_done_callback(lambda f: _finish(res, f))

    async def _background(self, payload: dict[str, Any], m: VersionManifest, res: TierResult,
                          prev: concurrent.futures.Future[None] | None) -> None:
        if prev is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(prev)
        if self.tcfg.replicas:
            try:
                await self._replicate(payload, m)
                res.reached["replicated"] = time.time() - res.committed_at
                self._newest_replicated = m.version_id
            except Exception as err:
                res.errors["replicated"], res.failures["replicated"] = str(err), err
                log.error("%s did not reach the replica tier: %s", m.version_id, err)
        if self.remote is not None:
            try:
                await self._upload(payload, m)
                res.reached["remote"] = time.time() - res.committed_at
                self._newest_remote = m.version_id
            except Exception as err:
                res.errors["remote"], res.failures["remote"] = str(err), err
                log.error("%s did not reach the remote tier: %s", m.version_id, err)
        self._pending.discard(m.version_id)  # every slower tier has had its copy
        try:
            await self._retention()
        except Exception as err:  # the versions are committed; retried after the next save
            log.warning("tier retention after %s failed: %r", m.version_id, err)

    async def _gloo(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def _replicate(self, payload: dict[str, Any], m: VersionManifest) -> None:
        """Each rank's files to its holders; holders keep them with the manifest.

        A file that cannot be read (EIO, gone) fails that file only: its owner sends an
        empty message in its place, so the exchange still completes on both sides (a rank
        that skipped it would leave its peers waiting until the deadline and the tier group
        broken for every later version). The holder learns the file is missing, keeps the
        copies that did arrive, and every rank reports the version's replication failed,
        naming each file; the next version replicates as usual."""
        assert self.layout is not None
        owned = owned_files(m)
        problems: list[str] = []
        mine: dict[str, Payload] = {}
        for need in owned.get(self.rank, []):
            try:
                mine[need.key] = (await _mapped(self.store, need.key)
                                  or await self.store.get(need.key))
            except Exception as err:
                mine[need.key] = b""
                problems.append(f"cannot read {need.key} ({type(err).__name__}: {err})")
        sends: list[tuple[int, int, Payload]] = []
        recvs: list[tuple[int, int]] = []
        meta: dict[int, tuple[int, Need]] = {}
        tag = 0
        for r in range(self.world):  # tags numbered the same way on every rank
            for h in self.nodes.replica_holders(r, self.tcfg.replicas):
                for need in owned.get(r, []):
                    tag += 1
                    if r == self.rank:
                        sends.append((h, tag, mine[need.key]))
                    elif h == self.rank:
                        recvs.append((r, tag))
                        meta[tag] = (r, need)
        mine.clear()
        try:
            peers = sorted({h for h, _, _ in sends} | {r for r, _ in recvs})
            got = await self._gloo(self.link.exchange, sends, recvs,
                                   f"{m.version_id}: copies to/from rank(s) {peers} "
                                   "(tier replicated)")
            sends.clear()
            for t, data in got.items():
                r, need = meta[t]
                if not data:
                    problems.append(f"{need.key} from rank {r} is missing (its owner could "
                                    "not send it)")
                elif not intact(data, need):
                    problems.append(str(ChecksumMismatch(
                        f"replica of {need.key} from rank {r}", need.xxh64 or "?",
                        xxhash.xxh64_hexdigest(data))))
                else:
                    await self.replica_store.put(need.key, data)
        except Exception as err:
            problems.append(f"{type(err).__name__}: {err}")
        held_any = bool(recvs)
        if held_any and not problems:
            try:
                await _write_meta(self.replica_store, payload, "replicated")
            except Exception as err:
                problems.append(f"{type(err).__name__}: {err}")
        error = f"rank {self.rank}: {'; '.join(problems)}" if problems else None
        statuses = await self._gloo(self.link.all_gather, error, "tiers: replication status")
        bad = [s for s in statuses if s is not None]
        if bad:
            raise DistributedError(f"{m.version_id}: tier replicated failed: {'; '.join(bad)}")
        if held_any:
            await move_alias(self.replica_store, self.layout, "latest_replicated", m,
                             payload["manifest_key"])

    async def _upload(self, payload: dict[str, Any], m: VersionManifest) -> None:
        """Each rank uploads what it wrote; rank 0 publishes the manifest once all are in.

        Every object is written once (:func:`~mithril_async.tiers.write_once.put_once`): an
        object the remote already holds under one of this version's keys with other bytes
        is left alone and fails the upload with :class:`KeyExists` on every rank; the
        manifest is then not published and ``latest`` does not move."""
        assert self.layout is not None and self.remote is not None
        error: tuple[str, str] | None = None
        try:
            for need in owned_files(m).get(self.rank, []):
                await put_once(self.remote, need.key, await self.store.get(need.key), "remote")
            ckey = payload["config_key"]
            if self.rank == 0 and ckey is not None and ckey != self._config_on_remote:
                await put_once(self.remote, ckey, payload["config"], "remote")
                self._config_on_remote = ckey
        except Exception as err:
            error = (type(err).__name__, f"rank {self.rank}: {type(err).__name__}: {err}")
        statuses = await self._gloo(self.link.all_gather, error, "tiers: upload status")
        bad = [s for s in statuses if s is not None]
        published: tuple[str, str] | None = None
        if not bad and self.rank == 0:
            try:
                await put_once(self.remote, payload["manifest_key"], payload["manifest"],
                               "remote")
                cat = RunCatalog(self.remote, self.layout)
                await cat.move_latest(m, payload["manifest_key"])
                await move_alias(self.remote, self.layout, "latest_remote", m,
                                 payload["manifest_key"])
                policy = from_config(self.cfg)
                if policy is not None:
                    await apply_retention(cat, policy)
            except Exception as err:
                published = (type(err).__name__, f"rank 0: {type(err).__name__}: {err}")
        if not bad:
            outcome = await self._gloo(self.link.all_gather, published, "tiers: remote commit")
            bad = [s for s in outcome if s is not None]
        if bad:
            msg = f"{m.version_id}: tier remote failed: {'; '.join(text for _, text in bad)}"
            if any(kind == KeyExists.__name__ for kind, _ in bad):
                raise KeyExists(msg)
            raise DistributedError(msg)

    async def _retention(self) -> None:
        """Node lead: keep the newest ``keep_local`` / ``keep_replicated`` versions, and the
        newest version complete on the remote as long as no newer one survives a node loss
        (complete on the replica tier or the remote): while uploads and replication fail, the
        fast tiers keep the last durable recovery point instead of aging it out. A version
        whose replication and upload have not run yet (saves committed while an upload
        lags) is never deleted from the node folder: they copy it from there."""
        if not self.lead or self.layout is None:
            return
        for store, keep in ((self.store, self.tcfg.keep_local),
                            (self.replica_store, self.tcfg.keep_replicated)):
            if keep is None:
                continue
            cat = RunCatalog(store, self.layout)
            numbers = await cat.version_numbers()
            committed = sorted(f"v{n:06d}" for n, ok in numbers.items() if ok)
            doomed = committed[:-keep] if len(committed) > keep else []
            nr, rep = self._newest_remote, self._newest_replicated
            if nr is not None and (rep is None or rep <= nr):
                doomed = [v for v in doomed if v != nr]
            if store is self.store:
                pending = set(self._pending)
                doomed = [v for v in doomed if v not in pending]
            for vid in reversed(doomed):  # newest first, like the manager's retention
                await cat.delete_version(vid)

    async def claim_above_floor(self, claim: Callable[[], Any]) -> int:
        """Rank 0's version claim: above every version folder any rank's tiers (and the
        remote) showed when the manager was made or at the last recovery. Why: rank 0 claims
        in its own node folder, which need not hold the newest version another node or the
        remote holds (a recovery that took an older version, say because the newest one had
        not reached the replicas when a node died, or a fresh node 0). Reusing that number
        would put a second version under a name another tier already holds. A claim of the
        floor's number is held while the save claims (so it claims above), then dropped."""
        assert self.layout is not None
        n = self.floor
        held: bytes | None = None
        mine = [version_number(v) for v in await self._folders(self.store)]
        if max(mine, default=0) < n:
            with contextlib.suppress(KeyExists):
                held = await RunCatalog(self.store, self.layout).claim_number(n)
        try:
            return int(await claim())
        finally:
            if held is not None:
                key = self.layout.claim_key(n)
                with contextlib.suppress(Exception):
                    if await self.store.get(key) == held:
                        await self.store.delete(key)

    def wait(self, timeout: float | None = None) -> list[TierResult]:
        """Wait for the background tier work of every save so far; return the results."""
        if self._last is not None:
            concurrent.futures.wait([self._last], timeout)
        return list(self.results.values())

    # ------------------------------------------------------------------ recovery
    def recover(self, target: str = "latest") -> str:
        """Make this rank's node folder hold a verified copy of what it needs to restore the
        newest version complete on some tier (or ``target``, a version id); return its id.
        Every rank calls it at the same point; then ``manager.restore_sync(vid)``.

        Every file is hashed here and written into the node folder before this returns;
        :meth:`restore` takes the faster path (the reader's own verification, copies served
        from memory and written back in the background)."""
        if self.layout is None:
            raise ConfigError("Tiers.recover: create the manager first (Tiers.manager)")
        self.wait()
        rec = self._loop.run(self._recover(target, light=False, targets=self._targets))
        self._loop.run(self._settle(rec, [k for k in rec.sources if rec.sources[k] != "local"],
                                    self._hydrate))
        self._finish_recovery(rec)
        return rec.vid

    def restore(self, manager: Any, target: str = "latest") -> Any:
        """Restore the newest version complete on some tier (or ``target``) into ``manager``'s
        state; every rank calls it at the same point. Returns what ``restore_sync`` returns.

        Why it is faster than :meth:`recover` then ``restore_sync``, and as safe: files on
        this node's folder are only checked for presence and size here, and copies fetched
        from a peer only by size (files up to ``_SMALL`` are hashed): the manager's one
        reader verifies every file it needs while it restores, as it does for any restore
        (``[checkpointing.restore] verify``), and the copies
        are served to it from memory (:attr:`NodeStore.overlay`) instead of being written to
        disk and read back first. When any rank's restore fails, every rank joins a repair
        round: the failed ranks hash each copy they used, and a damaged one falls through to
        the next tier for that file only (hashed on arrival this time); then they restore
        again, which overwrites every tensor the failed attempt may have written. Copies
        from elsewhere than the own node's tier are written back into the node folder,
        durably, in the background once the restore succeeded: :meth:`wait` (also run by
        :meth:`close` and the next :meth:`restore`) returns after, and the next save's
        replication and upload queue behind it. A restore that fails in the end takes the
        manifest and the files it wrote out of the node folder again (:meth:`_undo`): the
        folder is left as the recovery found it, never with a manifest whose files are
        missing."""
        if self.layout is None:
            raise ConfigError("Tiers.restore: create the manager first (Tiers.manager)")
        self.wait()
        rec = self._loop.run(self._recover(
            target, light=True, targets=getattr(manager, "_reshard_targets", self._targets)))
        out: Any = None
        err: BaseException | None = None
        try:
            self.store.overlay = rec.overlay(self.replica_store)
            out, err = _attempt(manager, rec.vid)
            state = "ok" if err is None else "failed"
            rounds = 0
            while True:
                states = self._loop.run(self._gloo(self.link.all_gather, state,
                                                   "tiers: restore status"))
                if "failed" not in states:
                    break
                rounds += 1
                fixed = self._loop.run(self._repair(rec, state == "failed", rounds))
                self.store.overlay = rec.overlay(self.replica_store)
                if state == "failed":
                    if fixed:
                        out, err = _attempt(manager, rec.vid)
                        state = "ok" if err is None else "failed"
                    else:  # every copy it used is intact: not a damaged copy, no retry
                        state = "hopeless"
        finally:
            self.store.overlay = {}
        rec.marks["restored"] = time.perf_counter() - rec.t0
        self._finish_recovery(rec)
        if err is not None:
            self._loop.run(self._undo(rec))
            raise err
        back = [(k, rec.data.get(k)) for k, s in rec.sources.items()
                if s != "local" and k not in rec.written]
        if back:
            prev = self._last
            self._last = self._loop.submit(self._write_back(rec, back, prev))
        return out

    def _finish_recovery(self, rec: Recovery) -> None:
        self.last_sources = dict(rec.sources)
        self.last_timings = rec.marks
        log.info("rank %d recovers %s from %s", self.rank, rec.vid,
                 json.dumps(sorted(set(rec.sources.values()))))

    async def _versions(self, store: Store) -> list[str]:
        """Versions whose manifest ``store`` holds (a node folder: one walk)."""
        assert self.layout is not None
        keys = await store.list(self.layout.versions_prefix)
        return sorted({k.split("/")[-2] for k in keys if k.endswith("/manifest.json")})

    async def _folders(self, store: Store) -> list[str]:
        """Names of the version folders ``store`` holds, complete or not: one LIST with a
        delimiter (a remote bucket: one request per 1000 versions, no key of any blob)."""
        assert self.layout is not None
        out = []
        for name in (await store.list_dir(self.layout.versions_prefix)).dirs:
            with contextlib.suppress(InvalidFormat):
                out.append(version_id(version_number(name)))
        return sorted(out)

    async def _recover(self, target: str, *, light: bool, targets: Targets | None = None
                       ) -> Recovery:
        """Collective: choose the version and get every file this rank needs onto this node.

        ``light``: a file in the node folder is checked by size, a copy from a peer by size
        (the reader verifies both while restoring; :meth:`_repair` if it finds damage);
        else every file is hashed here. Copies from the remote are always hashed (one file
        from the bucket is cheap to hash next to its download)."""
        assert self.layout is not None
        t0 = time.perf_counter()
        remote_list = (asyncio.ensure_future(self._folders(self.remote))
                       if self.rank == 0 and self.remote is not None else None)
        mine = {"local": await self._versions(self.store),
                "replica": await self._versions(self.replica_store),
                # version folders (one LIST, no GET); complete = its manifest (a HEAD) below
                "remote": await remote_list if remote_list is not None else []}
        inv = await self._gloo(self.link.all_gather, mine, "tiers: recovery inventory")
        marks: dict[str, float] = {"inventory": time.perf_counter() - t0}

        def fast(v: str) -> bool:
            return all(v in inv[r]["local"] or any(
                v in inv[h]["replica"] for h in self.nodes.replica_holders(r, self.tcfg.replicas))
                for r in range(self.world))

        every = sorted({v for d in inv for t in ("local", "replica", "remote") for v in d[t]})
        if every:
            self.floor = max(self.floor, version_number(every[-1]))
        if target == "latest":
            fast_vs = [v for v in every if fast(v)]
            newest_fast = fast_vs[-1] if fast_vs else None
            # A version is uploaded only after every node committed it locally, so one newer
            # than every fast-complete version is on the remote only if fast tiers were lost
            # or replaced: then (and only then) rank 0 asks the remote which of those folders
            # holds a manifest (HEADs, newest first), and everyone takes its answer.
            newer = sorted((v for v in inv[0]["remote"]
                            if newest_fast is None or v > newest_fast), reverse=True)
            found: str | None = None
            if newer:
                if self.rank == 0:
                    assert self.remote is not None
                    for v in newer:
                        if await self.remote.exists(self.layout.manifest_key(version_number(v))):
                            found = v
                            break
                found = (await self._gloo(self.link.all_gather, found,
                                          "tiers: newest remote version"))[0]
            vid = found or newest_fast
            got = None if vid is None else await self._try_manifest(vid)
            held: list[dict[str, set[str]]] | None = None
            if got is None or got[0].world_size != self.world:
                # saved by another world size: the rule above follows the fixed replica
                # mapping of this job's nodes, not the saving job's; ask the holders instead
                elastic = await self._elastic_latest(inv, every, fast, targets)
                if elastic is not None:
                    vid, got, held = elastic[0], elastic[1:3], elastic[3]
            if vid is None or got is None:
                raise VersionNotFound(f"run {self.layout.run_id}: no version is complete on any "
                                      f"tier (local, replicated, remote)")
            m, mdata = got
        else:
            if target not in every:
                raise VersionNotFound(f"run {self.layout.run_id}: {target!r} is on no tier")
            vid, held = target, None
            got = await self._try_manifest(vid, strict=True)
            assert got is not None
            m, mdata = got
        # on another world size (a reshard): the saved ranks' blobs this rank's pieces overlap
        needs = restore_files(m, self.rank, self.world, targets)
        rec = Recovery(vid, m, inv, needs, t0=t0, marks=marks, mdata=mdata)
        if m.world_size != self.world:
            rec.held = held if held is not None else await self._held(m)
        for n in rec.needs:  # this node's folder: its own tier, then the copies it holds
            await self._from_node_folder(rec, n, light and n.key != _config_key(m))
        missing = [n.key for n in rec.needs if n.key not in rec.sources]
        marks["own folder"] = time.perf_counter() - t0
        await self._fetch(rec, missing, verify=not light)
        if light:  # small files on disk now: the next save reads the run's config file
            await self._settle(rec, [k for k, d in rec.data.items() if len(d) <= _SMALL],
                               self.store)
            marks["small files written"] = time.perf_counter() - t0
        return rec

    async def _settle(self, rec: Recovery, keys: list[str], store: LocalStore) -> None:
        """Once every file this rank needs is at hand: ``keys`` written into the node folder,
        then the version's manifest (the reader resolves the version there; the next save
        is numbered above it anyway, :attr:`floor`). Nothing is written before: a recovery
        that fails to find a file leaves the node folder as it was. A failed write takes
        back what this recovery wrote."""
        assert self.layout is not None
        try:
            await self._write(rec, keys, store)
            mkey = self.layout.manifest_key(version_number(rec.vid))
            if not await self.store.exists(mkey):
                with contextlib.suppress(KeyExists):
                    await self.store.put_if_absent(mkey, rec.mdata)
                    rec.manifest_created = True
        except BaseException:
            await self._undo(rec)
            raise

    async def _undo(self, rec: Recovery) -> None:
        """Take out of the node folder what this recovery put there (the manifest first, as
        every deletion of a version): for a recovery or restore that failed."""
        assert self.layout is not None
        keys = ([self.layout.manifest_key(version_number(rec.vid))]
                if rec.manifest_created else []) + rec.created
        for key in keys:
            try:
                await self.store.delete(key)
            except Exception as err:
                log.warning("rank %d: could not take %s (written by a failed recovery of %s) "
                            "out of %s: %r", self.rank, key, rec.vid, self.root, err)
        rec.manifest_created = False
        rec.created.clear()

    async def _elastic_latest(self, inv: list[dict[str, Any]], every: list[str],
                              fast: Callable[[str], bool], targets: Targets | None
                              ) -> tuple[str, VersionManifest, bytes,
                                         list[dict[str, set[str]]] | None] | None:
        """Collective: the newest version this job can restore when the newest one is saved
        by another world size (or none is complete by this job's replica mapping): newest
        first, a version counts if every file each rank's restore reads
        (:func:`restore_files`) is in some rank's node or replica folder (:meth:`_held`), or
        if its manifest is on the remote (written last, so every file is there). A version
        of this world size counts as before (``fast``, or complete on the remote). None if
        no version does. Why not the version-level rule alone: a node lost while a version
        was still being replicated leaves that version in the survivors' own folders but
        not every saved rank's files anywhere fast."""
        assert self.layout is not None
        for v in sorted(every, reverse=True):
            got = await self._try_manifest(v)
            if got is None:
                continue
            m = got[0]
            held: list[dict[str, set[str]]] | None = None
            if m.world_size == self.world:
                ok = fast(v)
            else:
                held = await self._held(m)
                needs = restore_files(m, self.rank, self.world, targets)
                mine = all(any(n.key in h["local"] or n.key in h["replica"] for h in held)
                           for n in needs)
                ok = all(await self._gloo(self.link.all_gather, mine,
                                          f"tiers: {v} held on the fast tiers"))
            if not ok and v in inv[0]["remote"]:
                on_remote = False
                if self.rank == 0:
                    assert self.remote is not None
                    on_remote = await self.remote.exists(
                        self.layout.manifest_key(version_number(v)))
                ok = (await self._gloo(self.link.all_gather, on_remote,
                                       f"tiers: {v} complete on the remote"))[0]
            if ok:
                return v, got[0], got[1], held
        return None

    async def _try_manifest(self, vid: str, *, strict: bool = False
                            ) -> tuple[VersionManifest, bytes] | None:
        """Collective: :meth:`_manifest`, or None on every rank when some rank found no
        readable manifest that stays inside the run on any tier (a version folder without
        its manifest: an upload or save that never finished; or a planted or damaged one).
        ``strict``, or any other error (a remote that fails): raised on every rank (that
        rank's own error; on the others a ``VersionNotFound`` or ``DistributedError``
        naming the ranks)."""
        got: tuple[VersionManifest, bytes] | None = None
        error: Exception | None = None
        try:
            got = await self._manifest(vid)
        except Exception as err:
            error = err
            log.warning("tiers: %s has no readable manifest on this rank's tiers (%s: %s)",
                        vid, type(err).__name__, err)
        kind = None if got is not None else (
            "missing" if isinstance(error, (VersionNotFound, KeyNotFound, InvalidFormat))
            else "error")
        kinds = await self._gloo(self.link.all_gather, kind, f"tiers: {vid} manifest")
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
        raise VersionNotFound(f"{vid}: rank(s) {failed} found no readable manifest of it on "
                              "any tier")

    async def _manifest(self, vid: str) -> tuple[VersionManifest, bytes]:
        """Collective: ``vid``'s manifest, from this node, else the lowest rank holding it,
        else the remote. Every copy, wherever it comes from, passes the restore reader's
        checks (:func:`confined_manifest`: inside this run, the right version, safe keys)
        before anything it names is fetched or written; a copy that fails them is skipped
        like a missing one (the remote's is raised: it is the last tier)."""
        assert self.layout is not None
        mkey = self.layout.manifest_key(version_number(vid))
        got: tuple[VersionManifest, bytes] | None = None
        for store in (self.store, self.replica_store):
            try:
                got = await read_confined(store, self.layout, mkey)
            except (InvalidFormat, StorageError) as err:
                log.warning("rank %d: %s in %s is refused: %s", self.rank, mkey, store.url, err)
            if got is not None:
                break
        have = await self._gloo(self.link.all_gather, got is not None, "tiers: manifest needs")
        src = next((r for r, ok in enumerate(have) if ok), None)
        if src is not None and not all(have):
            sends = [(r, r + 1, got[1]) for r, ok in enumerate(have)
                     if not ok and self.rank == src and got is not None]
            recvs = [(src, self.rank + 1)] if not have[self.rank] else []
            sent = await self._gloo(self.link.exchange, sends, recvs,
                                    f"recovery: manifest {mkey}")
            if recvs:
                data = bytes(sent.get(self.rank + 1, b""))
                try:
                    got = (await confined_manifest(self.layout, mkey, data), data)
                except InvalidFormat as err:
                    log.warning("rank %d: %s from rank %d is refused: %s", self.rank, mkey,
                                src, err)
        if got is None:
            if self.remote is None:
                raise VersionNotFound(f"{mkey}: on no tier")
            got = await read_confined(self.remote, self.layout, mkey)
            if got is None:
                raise VersionNotFound(f"{mkey}: on no tier")
        return got

    async def _held(self, m: VersionManifest) -> list[dict[str, set[str]]]:
        """Collective, for a version saved by another world size: which of its files each
        rank's node folder and replica folder hold (present, of the manifest's size where it
        gives one). The fixed replica mapping of :mod:`~mithril_async.tiers.topology` is
        that of the saving job's nodes, not this one's, so the holders are asked instead."""
        files = [n for r_files in owned_files(m).values() for n in r_files]
        if m.config is not None:
            files.append(Need(m.config.key, 0, m.config.bytes, m.config.xxh64))
        keys = sorted({n.key: n for n in files}.items())

        def scan() -> dict[str, list[int]]:  # one thread for every stat (thousands of files)
            mine: dict[str, list[int]] = {"local": [], "replica": []}
            for tier, store in (("local", self.store), ("replica", self.replica_store)):
                for i, (key, n) in enumerate(keys):
                    try:
                        st = os.stat(store.local_path(key))
                    except (OSError, StorageError, InvalidFormat):
                        continue
                    if stat.S_ISREG(st.st_mode) and st.st_size > 0 and (
                            n.bytes is None or st.st_size == n.bytes):
                        mine[tier].append(i)
            return mine

        mine = await asyncio.to_thread(scan)
        got = await self._gloo(self.link.all_gather, mine, "tiers: files held (reshard)")
        return [{t: {keys[i][0] for i in d[t]} for t in ("local", "replica")} for d in got]

    async def _from_node_folder(self, rec: Recovery, n: Need, light: bool) -> None:
        """Take ``n`` from this node's folder, else the node's replica folder, if a copy
        there passes the check (``light``: presence and size; else the whole XXH64)."""
        tried = rec.tried.get(n.key, set())
        for store, tier in ((self.store, "local"), (self.replica_store, "local replica")):
            if tier in tried:
                continue
            if light:
                try:
                    size = await LocalStore.size(store, n.key)
                except (KeyNotFound, FileNotFoundError):
                    continue
                if n.bytes is None or size == n.bytes:
                    rec.sources[n.key] = tier
                    return
            else:
                blob = await _get_or_none(store, n.key)
                if intact(blob, n):
                    assert blob is not None
                    rec.sources[n.key] = tier
                    rec.verified.add(n.key)
                    if tier != "local":
                        rec.data[n.key] = blob
                    return
                if blob is not None:
                    rec.tried.setdefault(n.key, set()).add(tier)

    async def _fetch(self, rec: Recovery, missing: list[str], *, verify: bool) -> None:
        """Collective: every rank's ``missing`` files from the ranks whose folders hold a
        copy (its owner's node folder, then each replica holder's in turn; one plan computed
        alike on every rank), else a GET from the remote. Round after round, a file whose
        copy arrived damaged or missing is asked of the next holder, until every holder was
        tried: only then does the remote (or the failure) come. A copy is accepted by size
        (``verify``, or a file of at most ``_SMALL`` bytes: by XXH64); places whose copy was
        damaged before (``rec.tried``) are not asked again.
        Raises :class:`DistributedError` on every rank when a file is intact nowhere."""
        m, vid = rec.manifest, rec.vid
        by_key = {n.key: n for n in rec.needs}
        for r_files in owned_files(m).values():
            by_key.update({n.key: n for n in r_files})
        by_key.update({n.key: n for n in needed_files(m, 0)})
        while True:
            wants = await self._gloo(
                self.link.all_gather,
                [(k, sorted(t for t in rec.tried.get(k, ()) if isinstance(t, int)))
                 for k in missing if k not in rec.sources], "tiers: recovery needs")
            plan = self._fetch_plan(rec, wants)
            if not plan:  # every rank computed the same plan: all leave the loop together
                break
            await self._fetch_round(rec, plan, by_key, verify)
        rec.marks["peers"] = time.perf_counter() - rec.t0
        error: str | None = None
        for key in missing:
            if key in rec.sources:
                continue
            n = by_key[key]
            try:
                if self.remote is None:
                    raise KeyNotFound(f"{key}: not intact on the local or replica tier and "
                                      "there is no remote tier")
                if "remote" in rec.tried.get(key, ()):
                    raise ChecksumMismatch(f"{key}: the remote tier's copy", n.xxh64 or "?",
                                           "a copy that did not verify before")
                fetched_remote = await self.remote.get(key)
                if not intact(fetched_remote, n):
                    rec.tried.setdefault(key, set()).add("remote")
                    raise ChecksumMismatch(f"{key} on the remote tier", n.xxh64 or "?",
                                           xxhash.xxh64_hexdigest(fetched_remote))
                rec.data[key], rec.sources[key] = fetched_remote, "remote"
                rec.verified.add(key)
            except Exception as err:
                error = (f"rank {self.rank}: {key} of {vid} is intact on no tier "
                         f"({type(err).__name__}: {err})")
                break
        rec.marks["remote"] = time.perf_counter() - rec.t0
        statuses = await self._gloo(self.link.all_gather, error, "tiers: recovery status")
        bad = [s for s in statuses if s is not None]
        if bad:
            raise DistributedError(f"tier recovery of {vid} failed: {bad[0]}")

    def _fetch_plan(self, rec: Recovery, wants: list[list[tuple[str, list[int]]]]
                    ) -> list[tuple[int, int, int, str, str]]:
        """``(dst, src, tag, tier, key)`` for every file a rank wants from a peer this round:
        the first holder (owner's node folder, then replica holders in order; with a
        reshard, the ranks that announced it) that is not in the asker's own folders and
        whose copy did not fail the asker before. The same plan, and tags, on every rank."""
        plan: list[tuple[int, int, int, str, str]] = []
        tag = 0
        for r in range(self.world):
            for key, skip in wants[r]:
                if rec.held is None:  # the same world: the fixed mapping names the holders
                    owner = owner_of(key)
                    cands = [(owner, "local")] + [
                        (h, "replica")
                        for h in self.nodes.replica_holders(owner, self.tcfg.replicas)]
                    cands = [(c, t) for c, t in cands if rec.vid in rec.inv[c][t]]
                else:  # a reshard: the ranks that said they hold the file, own copies first
                    cands = [(c, t) for t in ("local", "replica") for c in range(self.world)
                             if key in rec.held[c][t]]
                pick = next(((c, t) for c, t in cands if c != r and c not in skip
                             and not self._same_folder(c, r)), None)
                if pick is not None:
                    tag += 1
                    plan.append((r, pick[0], tag, pick[1], key))
        return plan

    async def _fetch_round(self, rec: Recovery, plan: list[tuple[int, int, int, str, str]],
                           by_key: dict[str, Need], verify: bool) -> None:
        """One exchange of ``plan``: this rank sends the copies asked of it (mapped, or an
        empty message for one it cannot read) and checks the ones it receives; a copy that
        is damaged or missing marks its sender as tried for that file."""
        mine = [(d, t, tier, k) for d, c, t, tier, k in plan if c == self.rank]
        datas = await asyncio.gather(*(
            _mapped(self.store if tier == "local" else self.replica_store, k)
            for _, _, tier, k in mine))
        sends = [(d, t, data) for (d, t, _, _), data in zip(mine, datas, strict=True)]
        del datas
        recvs = [(c, t) for d, c, t, _, _ in plan if d == self.rank]
        meta = {t: (c, tier, k) for d, c, t, tier, k in plan if d == self.rank}
        peers = sorted({d for d, _, _ in sends} | {c for c, _ in recvs})
        fetched = await self._gloo(self.link.exchange, sends, recvs,
                                   f"recovery of {rec.vid}: files to/from rank(s) {peers}")
        sends.clear()
        for t, blob in fetched.items():
            c, tier, key = meta[t]
            need = by_key[key]
            # small files are hashed here whatever ``verify`` says: they are written into
            # the node folder before the restore, and the run's config is not something the
            # reader reads (the next save records it)
            hashed = verify or len(blob) <= _SMALL
            ok = intact(blob, need) if hashed else (
                len(blob) > 0 and (need.bytes is None or len(blob) == need.bytes))
            if ok:
                rec.data[key], rec.sources[key] = blob, f"rank {c} ({tier})"
                if hashed:
                    rec.verified.add(key)
            else:
                rec.tried.setdefault(key, set()).add(c)
                log.warning("%s: the copy from rank %d (%s) is damaged or missing; trying "
                            "the next holder", key, c, tier)

    async def _repair(self, rec: Recovery, mine: bool, round_: int) -> bool:
        """Collective, after a restore failed on some rank. A failed rank (``mine``) hashes
        every copy it used that nothing has hashed yet; a damaged one falls through to the
        next tier for that file only (:meth:`_from_node_folder`, then :meth:`_fetch`, now
        hashing on arrival). True if this rank replaced a copy (so restoring again can
        succeed)."""
        missing: list[str] = []
        damaged = 0
        if mine:
            for n in rec.needs:
                if n.key in rec.verified:
                    continue
                src = rec.sources[n.key]
                if n.key in rec.data:
                    copy: bytes | memoryview | None = rec.data[n.key]
                else:
                    store = self.store if src == "local" else self.replica_store
                    copy = await _get_or_none(store, n.key)
                if intact(copy, n):
                    rec.verified.add(n.key)
                    continue
                log.warning("%s: the copy from %s does not verify; trying the next tier",
                            n.key, src)
                damaged += 1
                peer = re.fullmatch(r"rank (\d+) \(.*\)", src)
                rec.tried.setdefault(n.key, set()).add(int(peer.group(1)) if peer else src)
                del rec.sources[n.key]
                rec.data.pop(n.key, None)
                rec.written.discard(n.key)
                await self._from_node_folder(rec, n, light=False)
                if n.key not in rec.sources:
                    missing.append(n.key)
        await self._fetch(rec, missing, verify=True)
        await self._write(rec, [k for k in missing if k in rec.data
                                and len(rec.data[k]) <= _SMALL], self.store)
        rec.marks[f"repair {round_}"] = time.perf_counter() - rec.t0
        return damaged > 0

    async def _write(self, rec: Recovery, keys: list[str], store: LocalStore) -> None:
        """Copies of ``keys`` into ``store`` (the node folder), now; the ones it did not
        hold before are remembered (:meth:`_undo`)."""
        for key in keys:
            data = rec.data.get(key)
            if data is None:  # a copy in this node's replica folder
                data = await self.replica_store.get(key)
            if not await store.exists(key):
                rec.created.append(key)
            await store.put(key, data)
            rec.written.add(key)

    async def _write_back(self, rec: Recovery,
                          items: list[tuple[str, bytes | memoryview | None]],
                          prev: concurrent.futures.Future[None] | None) -> None:
        """After a restore, in the background: the copies it used from elsewhere, durably
        into the node folder, so that this node's tier holds the version again (a later
        recovery, or a peer's, finds it here). Each copy not hashed yet is hashed whole
        first (the reader verified what it read, which need not be every byte of a file):
        the node folder only ever gets intact copies. A failure only logs: the copy is
        fetched again next time."""
        if prev is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(prev)
        needs = {n.key: n for n in rec.needs}
        try:
            for key, data in items:
                copy = data if data is not None else await self.replica_store.get(key)
                if key not in rec.verified and key in needs and \
                        not await asyncio.to_thread(intact, copy, needs[key]):
                    log.warning("rank %d: %s from %s does not verify whole; not written "
                                "back", self.rank, key, rec.sources.get(key))
                    continue
                await self.store.put(key, copy)
            rec.marks["written back (background)"] = time.perf_counter() - rec.t0
        except Exception as err:
            log.warning("rank %d: writing the recovered copies of %s back into %s failed: "
                        "%r", self.rank, rec.vid, self.root, err)

    def _same_folder(self, a: int, b: int) -> bool:
        return not self.per_rank_folder and self.nodes.node_of[a] == self.nodes.node_of[b]


def _attempt(manager: Any, vid: str) -> tuple[Any, BaseException | None]:
    try:
        return manager.restore_sync(vid), None
    except Exception as err:
        return None, err


def _config_key(m: VersionManifest) -> str | None:
    return None if m.config is None else m.config.key


@dataclass
class Recovery:
    """One recovery on this rank: the version, where each file it needs is, what is hashed."""

    vid: str
    manifest: VersionManifest
    inv: list[dict[str, Any]]
    needs: list[Need]
    t0: float
    marks: dict[str, float]
    #: key -> where the copy in use is: "local" (this node's folder), "local replica" (the
    #: node's replica folder), "rank N (local|replica)" (a peer sent it), "remote"
    sources: dict[str, str] = field(default_factory=dict)
    #: copies fetched into memory, by key (files in the node's own folders are not here)
    data: dict[str, bytes | memoryview] = field(default_factory=dict)
    #: copies hashed whole against the manifest (the others the reader verifies)
    verified: set[str] = field(default_factory=set)
    #: key -> where a damaged copy came from: a tier name, or the rank that sent it
    tried: dict[str, set[str | int]] = field(default_factory=dict)
    #: copies already written into the node folder
    written: set[str] = field(default_factory=set)
    #: for a version saved by another world size: the files each rank's node folder
    #: ("local") and replica folder ("replica") hold (:meth:`Tiers._held`); None otherwise
    held: list[dict[str, set[str]]] | None = None
    #: the manifest's bytes (checked by :func:`confined_manifest`)
    mdata: bytes = b""
    #: whether this recovery wrote the manifest into the node folder, and the files it
    #: wrote there that the folder did not hold (what :meth:`Tiers._undo` takes back)
    manifest_created: bool = False
    created: list[str] = field(default_factory=list)

    def overlay(self, replica: Store) -> dict[str, bytes | memoryview | Store]:
        """What the node folder serves from elsewhere while the reader restores."""
        out: dict[str, bytes | memoryview | Store] = {}
        for key, src in self.sources.items():
            if key in self.data:
                out[key] = self.data[key]
            elif src == "local replica":
                out[key] = replica
        return out


async def _mapped(store: LocalStore, key: str) -> Payload:
    """``key``'s file mapped read-only, to send from the page cache without reading it into
    a buffer first (~0.15 s less per 200 MB on the test machine); ``b""`` when it is missing
    or empty. The tier layer's files are only ever replaced (written aside, renamed), never
    truncated in place, so the map stays valid while gloo reads it."""

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


async def _get_or_none(store: Store, key: str) -> bytes | None:
    try:
        return await store.get(key)
    except (KeyNotFound, FileNotFoundError):
        return None


async def _write_meta(store: Store, payload: dict[str, Any], tier: str) -> None:
    """The run's config file and the version's manifest (manifest last) into ``store``. The
    manifest is written once: another version's manifest under this number there is a
    :class:`KeyExists` (the save's own commit on node 0 wrote these very bytes)."""
    if payload["config_key"] is not None and not await store.exists(payload["config_key"]):
        with contextlib.suppress(KeyExists):
            await store.put_if_absent(payload["config_key"], payload["config"])
    await put_once(store, payload["manifest_key"], payload["manifest"], tier)


def _finish(res: TierResult, fut: concurrent.futures.Future[None]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        res.errors.setdefault("background", repr(exc))
    if not res.done.done():
        res.done.set_result(None)
