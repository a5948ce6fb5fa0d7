"""The local-tier commit, added to the save protocol by wrapping the manager's coordinator.

The save protocol itself (:mod:`mithril_async.save.job`) is unchanged; :class:`TierCoordinator`
wraps the usual coordinator and adds, at each step:

- ``agree_version``: rank 0 claims above every version number the tiers hold
  (:mod:`~mithril_async.tiers.numbering`).
- ``gather_parts``: rank 0's pre-commit check asks its store for every blob's size, and the
  blobs of ranks on other nodes lie on their own disks: the sizes those ranks reported durable
  in this save's gather stand in for them (``NodeStore.reported``, cleared after the verdict).
- ``broadcast_outcome``: after a committed verdict, rank 0 broadcasts the manifest and the
  run's config file (:class:`VersionMeta`) on the save protocol's own group, and the lowest
  rank of every node writes them into its node folder and moves ``latest_local``: the version
  is committed on every node's folder before the save's handle resolves. Then its replication
  and upload are queued (:mod:`~mithril_async.tiers.background`).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mithril_async.catalog import RunCatalog
from mithril_async.errors import KeyExists, KeyNotFound, StorageError
from mithril_async.layout import RunLayout
from mithril_async.manifest import VersionManifest, parse_model
from mithril_async.save.coordinator import Coordinator, GroupBacked, Outcome, RankPart
from mithril_async.storage.base import Store
from mithril_async.tiers.node_store import NodeStore
from mithril_async.tiers.numbering import claim_above
from mithril_async.tiers.write_once import put_once


@dataclass(frozen=True)
class VersionMeta:
    """What every node needs to commit a version locally: the manifest (and its key) and the
    run's config file the manifest names (None if it names none)."""

    manifest_key: str
    manifest: bytes
    config_key: str | None
    config: bytes | None

    @classmethod
    async def read(cls, store: Store, manifest_key: str) -> VersionMeta:
        """Rank 0, after its commit: the manifest and config file from its store."""
        data = await store.get(manifest_key)
        m = parse_model(VersionManifest, data, manifest_key)
        conf = None
        if m.config is not None:
            with contextlib.suppress(KeyNotFound, FileNotFoundError):
                conf = await store.get(m.config.key)
        return cls(manifest_key, data, None if conf is None or m.config is None
                   else m.config.key, conf)

    def parsed(self) -> VersionManifest:
        return parse_model(VersionManifest, self.manifest, self.manifest_key)

    def to_doc(self) -> dict[str, str | None]:
        """As JSON (the bytes in base64): what crosses the checkpoint workers' links."""
        return {"manifest_key": self.manifest_key,
                "manifest": base64.b64encode(self.manifest).decode(),
                "config_key": self.config_key,
                "config": None if self.config is None else base64.b64encode(self.config).decode()}

    @classmethod
    def of_doc(cls, doc: Any) -> VersionMeta:
        """The inverse of :meth:`to_doc`; anything else is a :class:`StorageError`."""
        try:
            conf = doc["config"]
            return cls(str(doc["manifest_key"]), base64.b64decode(doc["manifest"], validate=True),
                       None if doc["config_key"] is None else str(doc["config_key"]),
                       None if conf is None else base64.b64decode(conf, validate=True))
        except (KeyError, TypeError, ValueError) as err:
            raise StorageError(f"tier local: no valid version manifest was sent "
                               f"({type(err).__name__}: {err})") from None


async def write_meta(store: Store, meta: VersionMeta, tier: str) -> None:
    """The run's config file and the version's manifest (manifest last) into ``store``. The
    manifest is written once: another version's manifest under this number there is a
    :class:`KeyExists` (the save's own commit on node 0 wrote these very bytes)."""
    if meta.config_key is not None and meta.config is not None \
            and not await store.exists(meta.config_key):
        with contextlib.suppress(KeyExists):
            await store.put_if_absent(meta.config_key, meta.config)
    await put_once(store, meta.manifest_key, meta.manifest, tier)


def part_sizes(p: RankPart) -> dict[str, int]:
    """Every file one rank reported durable in a save's gather, with its size."""
    out: dict[str, int] = {}
    if p.model is not None:
        out[p.model.key] = p.model.bytes
    out.update({s.key: s.bytes for s in p.shards.values()})
    if p.lossy is not None:
        out.update({s.key: s.bytes for s in p.lossy.shards})
    if p.rng_key is not None and p.rng_bytes is not None:
        out[p.rng_key] = p.rng_bytes
    return out


class NodeCommit:
    """The node folder's part of a commit, run where the save runs (the training process, or
    its checkpoint worker): rank 0's claim above the tiers' ``floor``, and after a committed
    verdict the node lead's manifest and ``latest_local`` (``committed``: the last version's
    :class:`VersionMeta`, for the background work that follows it)."""

    def __init__(self, store: NodeStore, run: RunLayout | None, lead: bool) -> None:
        self.store = store
        self.run = run
        self.lead = lead
        #: the highest version number any tier held when last pooled: claims go above it
        self.floor = 0
        self.committed: VersionMeta | None = None

    async def claim(self, claim: Callable[[], Awaitable[int]]) -> int:
        if not self.floor:
            return await claim()
        assert self.run is not None, "the run's layout is set before any save"
        return await claim_above(self.store, self.run, self.floor, claim)

    async def commit_local(self, meta: VersionMeta) -> None:
        assert self.run is not None, "the run's layout is set before any save"
        if self.lead:
            await write_meta(self.store.local, meta, "local")
            await RunCatalog(self.store.local, self.run).move_alias(
                "latest_local", meta.parsed(), meta.manifest_key)
        self.committed = meta


@runtime_checkable
class Broadcasts(Protocol):
    """A coordinator that sends rank 0's value to every rank (the tier manifest rides on it)."""

    async def broadcast(self, value: Any, what: str = "broadcast") -> Any: ...


class CommitHooks(Protocol):
    """What the tier coordinator calls into (the tier layer of this process)."""

    @property
    def store(self) -> NodeStore:
        """This node's folder, the manager's store (its ``reported`` sizes)."""

    async def claim(self, claim: Callable[[], Awaitable[int]]) -> int:
        """Rank 0's version claim (above the tiers' floor)."""

    async def commit_local(self, meta: VersionMeta) -> None:
        """Every rank, after a committed verdict: the node's commit, then the background."""


class TierCoordinator:
    """The manager's coordinator with the local-tier commit added (module docstring)."""

    def __init__(self, inner: Coordinator, hooks: CommitHooks) -> None:
        self.inner = inner
        self.hooks = hooks
        self.rank = inner.rank
        self.world_size = inner.world_size

    @property
    def group(self) -> Any:
        """The inner coordinator's process group (:class:`GroupBacked`; None: none)."""
        return self.inner.group if isinstance(self.inner, GroupBacked) else None

    @property
    def timeout_s(self) -> float:
        """The inner coordinator's collective timeout (300 s when it has none)."""
        return self.inner.timeout_s if isinstance(self.inner, GroupBacked) else 300.0

    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        if self.rank == 0:
            return await self.inner.agree_version(lambda: self.hooks.claim(claim))
        return await self.inner.agree_version(claim)

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        parts = await self.inner.gather_parts(part)
        if parts is not None:  # rank 0: other nodes' blobs are durable on their own disks
            reported: dict[str, int] = {}
            for p in parts:
                if p.error is None:
                    reported.update(part_sizes(p))
            self.hooks.store.reported = reported
        return parts

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        try:
            out = await self.inner.broadcast_outcome(outcome)
        finally:
            self.hooks.store.reported = {}
        if not out.committed or out.manifest_key is None:
            return out
        sent: dict[str, Any] | str | None = None
        if self.rank == 0:
            try:
                sent = (await VersionMeta.read(self.hooks.store, out.manifest_key)).to_doc()
            except Exception as err:  # every rank must still leave the broadcast alike
                sent = (f"rank 0 could not read {out.manifest_key} back: "
                        f"{type(err).__name__}: {err}")
        if isinstance(self.inner, Broadcasts):
            sent = await self.inner.broadcast(sent, "tier_manifest")
        if not isinstance(sent, dict):
            raise StorageError(f"tier local: {sent}")
        await self.hooks.commit_local(VersionMeta.of_doc(sent))
        return out

    def close(self) -> None:
        self.inner.close()
