"""The tier layer of one process, as :class:`~mithril_async.manager.CheckpointManager` uses it.

A manager whose config has a ``[checkpointing.tiers]`` table builds a :class:`TierLayer` and runs
on it: its store is this node's folder (:class:`~mithril_async.tiers.node_store.NodeStore`), its
coordinator a :class:`~mithril_async.tiers.commit.TierCoordinator` around the usual one, and
its retention per tier. A save commits on every node's folder before its handle resolves
(:mod:`~mithril_async.tiers.commit`), then replicates to the peer nodes and uploads to the remote
in the background (:mod:`~mithril_async.tiers.background`); ``SaveResult.tiers`` says what it
reached. ``manager.restore()`` recovers each file from the fastest tier that holds it intact
(:mod:`~mithril_async.tiers.recovery`, :mod:`~mithril_async.tiers.fetch`,
:mod:`~mithril_async.tiers.restore`) and restores through the manager's one reader.

Every rank builds it at the same point (it creates a gloo group and gathers), from the same
config. Bad input fails here: a missing or unwritable local path, ``replicas`` >= nodes, delta
chains, dedup or the lossy tier (:class:`ConfigError`), an unreachable remote
(:class:`StorageError`). Then, when the manager is attached, the ranks pool the highest version
folder any tier holds, and the first save is numbered above it
(:mod:`~mithril_async.tiers.numbering`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

from mithril_async.config import CheckpointingConfig, Config
from mithril_async.distributed import DistCoordinator, dist_world
from mithril_async.errors import ConfigError, StorageError
from mithril_async.layout import RunLayout, new_run_id
from mithril_async.manifest import VersionManifest
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.restore.plan import LiveTargets, RestorePlan, make_plan
from mithril_async.save.coordinator import Coordinator, LocalCoordinator
from mithril_async.save.results import SaveResult
from mithril_async.storage import open_store
from mithril_async.storage.base import Store
from mithril_async.storage.local import LocalStore
from mithril_async.tiers.background import Background
from mithril_async.tiers.commit import NodeCommit, TierCoordinator, VersionMeta
from mithril_async.tiers.config import TiersConfig, check_local_root
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.fetch import Recovery
from mithril_async.tiers.files import files_to_restore
from mithril_async.tiers.node_store import NodeStore
from mithril_async.tiers.numbering import top_number
from mithril_async.tiers.recovery import FilesOf
from mithril_async.tiers.restore import recover, repair, settle, undo, write_back
from mithril_async.tiers.results import TierResult
from mithril_async.tiers.sources import Source
from mithril_async.tiers.topology import NodeMap
from mithril_async.tiers.transport import GlooLink, Link, LocalLink

log = logging.getLogger("mithril_async")

T = TypeVar("T")
OnSave = Callable[[SaveResult], None]


class Restorer(LiveTargets, Protocol):
    """What the tiers ask of the manager they serve: who it is, its run, and the live state
    its restores go into (the files a recovery fetches are those of the very plan its
    reader makes)."""

    rank: int
    world_size: int
    layout: RunLayout


class TierLayer:
    """The tiers of one process: node folder, replica folder, remote, the peer link, and the
    background work; see the module docstring. ``remote``: a store to use as the remote tier
    instead of opening ``[checkpointing.remote]`` (tests count its requests). ``link`` and
    ``node_map``: the peer link and node mapping instead of the ones torch.distributed
    gives."""

    def __init__(self, config: Config, *, remote: Store | None = None,
                 link: Link | None = None, node_map: NodeMap | None = None) -> None:
        cfg = config.checkpointing
        tcfg = _checked(cfg)
        world = dist_world()
        link = link or (GlooLink(tcfg.commit_timeout_s) if world is not None and world[1] > 1
                        else LocalLink())
        if node_map is None:
            hosts = (link.all_gather(socket.gethostname(), "tiers: gather hostnames")
                     if link.world_size > 1 else None)
            node_map = NodeMap.from_env(link.world_size, hosts)
        node_map.replica_holders(link.rank, tcfg.replicas)  # replicas >= nodes: ConfigError
        root = check_local_root(tcfg, node_map.node_of[link.rank], link.rank)
        self._loop = BackgroundLoop(name="mithril-tiers")
        remote = self._open_remote(cfg, tcfg, remote) if tcfg.upload else None
        if cfg.run_id is None:  # every rank uses rank 0's fresh run id
            config = config.model_copy(deep=True)
            config.checkpointing.run_id = link.all_gather(new_run_id(), "tiers: run id")[0]
        #: the manager's config (with the run id every rank agreed)
        self.config = config
        self.ctx = TierContext(link.rank, link.world_size, node_map, tcfg,
                               config.checkpointing, link, root, NodeStore(LocalStore(root)),
                               LocalStore(root / "replica"), remote, "{rank}" in tcfg.local)
        self.background = Background(self.ctx, self._loop)
        #: recovered copies written back into the node folder by the strict
        #: :meth:`recover`, without fsync: every read of them is verified against the
        #: manifest, so a copy torn by a power loss is only fetched again
        self._hydrate = LocalStore(root, durable=False)
        #: the node folder's part of each commit (rank 0's claim, the node lead's manifest)
        self.node = NodeCommit(self.ctx.store, None, self.ctx.lead)
        #: after a recovery: where each file this rank needed came from
        self.last_sources: dict[str, Source] = {}
        #: after a recovery: seconds from its start to the end of each phase
        self.last_timings: dict[str, float] = {}
        self._manager: Restorer | None = None
        self._closed = False

    @classmethod
    def of(cls, config: Config, *, remote: Store | None = None) -> TierLayer | None:
        """The tiers ``config`` asks for (``[checkpointing.tiers]``), None without the table;
        ``remote`` without the table is a :class:`ConfigError` (it would be ignored)."""
        if config.checkpointing.tiers is None:
            if remote is not None:
                raise ConfigError("a remote tier store was given but checkpointing.tiers is "
                                  "not set")
            return None
        return cls(config, remote=remote)

    def _open_remote(self, cfg: CheckpointingConfig, tcfg: TiersConfig,
                     remote: Store | None) -> Store | None:
        """The remote tier, reachable (one LIST); None without one."""
        if remote is None and cfg.remote is None:
            return None
        try:
            if remote is None:
                assert cfg.remote is not None
                remote = open_store(cfg.remote)
            self._loop.run(_probe(remote, cfg, tcfg), timeout=tcfg.commit_timeout_s + 5)
            return remote
        except BaseException:  # nothing of a TierLayer that failed to start stays running
            if remote is not None:
                with contextlib.suppress(Exception):
                    self._loop.run(remote.close())
            self._loop.close()
            raise

    # ------------------------------------------------------------------ the manager's parts
    @property
    def store(self) -> NodeStore:
        return self.ctx.store

    @property
    def root(self) -> Path:
        """This process's node folder."""
        return self.ctx.root

    @property
    def floor(self) -> int:
        """The highest version number any rank's tiers showed when the manager was attached
        or at the last recovery: rank 0 numbers the next save above it."""
        return self.node.floor

    @floor.setter
    def floor(self, value: int) -> None:
        self.node.floor = value

    @property
    def lead(self) -> bool:
        """This process keeps its node folder's books (``TierContext.lead``)."""
        return self.ctx.lead

    @property
    def results(self) -> dict[str, TierResult]:
        """Every version committed so far by id: which tiers it reached."""
        return self.background.results

    def parts(self, store: Store | None, runs_prefix: str | None,
              coordinator: Coordinator | None, on_save: OnSave | None
              ) -> tuple[Config, Store, str, Coordinator, OnSave]:
        """What a manager runs on: the config (run id agreed), this node's folder as its
        store and its runs prefix, the tier coordinator around ``coordinator`` (None: the
        usual one, bounded by ``commit_timeout_s``), and an ``on_save`` that fills
        ``SaveResult.tiers`` before calling the user's. ``store`` / ``runs_prefix`` given
        too are a :class:`ConfigError` (the node folder is the store)."""
        if store is not None or runs_prefix is not None:
            self.close()
            raise ConfigError("checkpointing.tiers: the manager's store is the node folder "
                              "(tiers.local); do not pass store= or runs_prefix= with tiers")
        if coordinator is None:
            coordinator = (DistCoordinator(timeout_s=self.ctx.tcfg.commit_timeout_s)
                           if self.ctx.world > 1 else LocalCoordinator())

        def filled(res: SaveResult) -> None:
            res.tiers = None if res.version_id is None else self.results.get(res.version_id)
            if on_save is not None:
                on_save(res)

        return (self.config, self.store, _runs_prefix(self.ctx.cfg),
                TierCoordinator(coordinator, self), filled)

    def attach(self, manager: Restorer) -> None:
        """Collective, at the end of the manager's construction: the run's layout, and the
        highest version folder any tier holds (the first save is numbered above it). The
        tiers close if it fails."""
        self._manager = manager
        self.ctx.layout = self.node.run = manager.layout
        try:
            self.floor = max(self.floor, self._loop.run(top_number(self.ctx)))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ commit hooks
    async def claim(self, claim: Callable[[], Awaitable[int]]) -> int:
        """Rank 0's version claim, above the tiers' floor."""
        return await self.node.claim(claim)

    async def commit_local(self, meta: VersionMeta) -> None:
        """Every rank, after the verdict: the node lead writes the manifest into its node
        folder and moves ``latest_local``; then the version's background work is queued."""
        m = meta.parsed()
        # before the manifest lands here: retention must see it as still to be copied
        self.background.pending.add(m.version_id)
        await self.node.commit_local(meta)
        self.background.committed(meta, m)

    def committed_by_worker(self, meta: VersionMeta) -> None:
        """A save the checkpoint worker committed on the node folder (its :class:`NodeCommit`
        wrote what :meth:`commit_local` writes): queue the version's background work here,
        where the tier group is."""
        self.background.committed(meta, meta.parsed())

    def wait(self, timeout: float | None = None) -> list[TierResult]:
        """Wait for the background tier work of every save (and write-back) so far."""
        return self.background.wait(timeout)

    def close(self) -> None:
        """Wait for the background tier work, then release the loop, stores and group."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.wait()
        if self.ctx.remote is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self.ctx.remote.close())
        self._loop.close()
        self.ctx.link.close()

    # ------------------------------------------------------------------ recovery
    def restore(self, target: str | int, load: Literal["all", "model"], fallback: bool,
                attempt: Callable[[str], T]) -> T:
        """Recover the newest version complete on some tier (or ``target``, a version id),
        then ``attempt(version id)`` (the manager's restore from its store); every rank calls
        it at the same point. Repair rounds and the write-back: :mod:`~.restore`."""
        if fallback:
            raise ConfigError("restore(fallback=True) is not supported with "
                              "checkpointing.tiers: a damaged copy is replaced from the next "
                              "tier that holds the file intact instead")
        self.wait()
        rec = self._recovered(str(target), light=True, load=load)
        try:
            self.store.overlay = rec.overlay(self.ctx.replica)
            out, err = self._attempts(rec, attempt)
        finally:
            self.store.overlay = {}
        rec.mark("restored")
        self._finished(rec)
        if err is not None:
            self._loop.run(undo(self.ctx, rec))
            raise err
        if any(k not in rec.written for k in rec.fetched()):
            self.background.queue(lambda: write_back(self.ctx, rec))
        return cast(T, out)  # err is None: what attempt returned

    def _attempts(self, rec: Recovery, attempt: Callable[[str], T]
                  ) -> tuple[T | None, BaseException | None]:
        """The restore, and repair rounds while it fails on some rank: a failed rank whose
        copies were all intact does not try again (the error is not a damaged copy)."""
        out, err = _attempt(attempt, rec.vid)
        state = "ok" if err is None else "failed"
        rounds = 0
        while "failed" in self._loop.run(self.ctx.gather(state, "tiers: restore status")):
            rounds += 1
            fixed = self._loop.run(repair(self.ctx, rec, state == "failed", rounds))
            self.store.overlay = rec.overlay(self.ctx.replica)
            if state == "failed":
                if fixed:
                    out, err = _attempt(attempt, rec.vid)
                    state = "ok" if err is None else "failed"
                else:
                    state = "hopeless"
        return out, err

    def recover(self, target: str = "latest") -> str:
        """The strict form: make this rank's node folder hold a verified copy of what it
        needs to restore the newest version complete on some tier (or ``target``), every file
        hashed and written before this returns; its version id. Every rank calls it at the
        same point; then ``manager.restore_sync(version id)``."""
        self.wait()
        rec = self._recovered(target, light=False, load="all")
        self._loop.run(settle(self.ctx, rec, rec.fetched(), self._hydrate))
        self._finished(rec)
        return rec.vid

    def _recovered(self, target: str, *, light: bool, load: Literal["all", "model"]
                   ) -> Recovery:
        if self._manager is None:
            raise ConfigError("the tiers recover for a manager: attach one first")
        rec, top = self._loop.run(recover(self.ctx, target, self._files(load), light=light))
        self.floor = max(self.floor, top)
        return rec

    def _files(self, load: Literal["all", "model"]) -> FilesOf:
        """What this rank's restore reads: the keys of the manager's restore plan."""
        mgr = self._manager
        assert mgr is not None
        items, rng = ({"model"}, False) if load == "model" else (None, True)

        def plan(m: VersionManifest) -> RestorePlan:
            return make_plan(m, rank=mgr.rank, world_size=mgr.world_size, items=items,
                             rng=rng, live=mgr)

        return lambda m: files_to_restore(m, plan)

    def _finished(self, rec: Recovery) -> None:
        self.last_sources = dict(rec.sources)
        self.last_timings = rec.marks
        log.info("rank %d recovers %s from %s", self.ctx.rank, rec.vid,
                 json.dumps(sorted({str(s) for s in rec.sources.values()})))


def _checked(cfg: CheckpointingConfig) -> TiersConfig:
    if cfg.tiers is None:
        raise ConfigError("checkpointing.tiers is not set (local = ..., replicas = ...)")
    if cfg.remote is not None and cfg.remote.mode == "remote_only":
        raise ConfigError("checkpointing.remote.mode = 'remote_only' does not combine with "
                          "checkpointing.tiers: saves commit on the node folder and reach the "
                          "remote tier in the background")
    comp = cfg.compression
    if comp.delta or comp.dedup or cfg.lossy.enabled:
        raise ConfigError("checkpointing.tiers: delta chains, dedup and the lossy tier are "
                          "not supported with tiers yet (compression.delta, "
                          "compression.dedup, lossy.enabled must be off)")
    return cfg.tiers


async def _probe(remote: Store, cfg: CheckpointingConfig, tcfg: TiersConfig) -> None:
    """One LIST of the runs folder: an unreachable remote is a :class:`StorageError` now."""
    where = remote.url or type(remote).__name__
    if cfg.remote is not None:
        r = cfg.remote
        where = f"s3://{r.bucket}/{r.prefix} at {r.endpoint_url or 'the default endpoint'}"
    try:
        await asyncio.wait_for(remote.list_dir(_runs_prefix(cfg)), tcfg.commit_timeout_s)
    except Exception as err:
        raise StorageError(f"checkpointing.remote: the remote tier {where} is unreachable at "
                           f"start ({type(err).__name__}: {err})") from err


def _runs_prefix(cfg: CheckpointingConfig) -> str:
    """The runs folder's key prefix in the node folder and on the remote."""
    return Path(cfg.runs_path).name or "runs"


def _attempt(attempt: Callable[[str], T], vid: str) -> tuple[T | None, BaseException | None]:
    try:
        return attempt(vid), None
    except Exception as err:
        return None, err


def __getattr__(name: str) -> Any:
    if name == "Tiers":  # the class's earlier name, for a release
        import warnings

        warnings.warn("mithril_async.tiers.layer.Tiers is now TierLayer", DeprecationWarning,
                      stacklevel=2)
        return TierLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
