"""What every part of one process's tier layer shares: who it is, each tier's store, the link.

Commit, background replication and upload, retention, numbering and recovery are separate
modules; each takes a :class:`TierContext` instead of reaching into one large object. It is
built once per manager (:class:`~mithril_async.tiers.layer.Tiers`) and, apart from the run's
layout (known once the manager agreed its run id), does not change.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mithril_async.config import CheckpointingConfig
from mithril_async.errors import InvalidFormat
from mithril_async.layout import RunLayout
from mithril_async.manifest import version_id, version_number
from mithril_async.storage.base import Store
from mithril_async.storage.local import LocalStore
from mithril_async.tiers.config import TiersConfig
from mithril_async.tiers.node_store import NodeStore
from mithril_async.tiers.topology import NodeMap

if TYPE_CHECKING:  # the link's module imports torch; a checkpoint worker imports this one
    from mithril_async.tiers.transport import Link, Payload


@dataclass
class TierContext:
    """One process's place in the tiers; see the module docstring."""

    rank: int
    world: int
    nodes: NodeMap
    tcfg: TiersConfig
    cfg: CheckpointingConfig
    link: Link
    #: this process's node folder (``tiers.local`` templated)
    root: Path
    #: the node folder, as the manager's store
    store: NodeStore
    #: ``<root>/replica``: the copies this node keeps for other nodes' ranks
    replica: LocalStore
    #: the remote tier (``[checkpointing.remote]``), None without one or with ``upload`` off
    remote: Store | None
    #: ``{rank}`` in ``tiers.local``: every rank has a folder of its own
    per_rank_folder: bool
    #: the run's layout, set when the manager is attached
    layout: RunLayout | None = None

    @property
    def node(self) -> int:
        return self.nodes.node_of[self.rank]

    @property
    def lead(self) -> bool:
        """This process keeps its folder's books (aliases, retention): the lowest rank of
        its node, or every rank when each has a folder of its own."""
        return self.per_rank_folder or self.nodes.is_lead(self.rank)

    @property
    def run(self) -> RunLayout:
        """The run's layout (the manager is attached before any tier work runs)."""
        assert self.layout is not None, "the tiers are not attached to a manager yet"
        return self.layout

    def holders(self, rank: int) -> list[int]:
        """The ranks keeping copies of ``rank``'s files, first replica first."""
        return self.nodes.replica_holders(rank, self.tcfg.replicas)

    def same_folder(self, a: int, b: int) -> bool:
        """Ranks ``a`` and ``b`` write into one folder (the same node, no ``{rank}``)."""
        return not self.per_rank_folder and self.nodes.node_of[a] == self.nodes.node_of[b]

    async def gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, over the tier group (blocking: on a worker thread)."""
        return await asyncio.to_thread(self.link.all_gather, obj, what)

    async def exchange(self, sends: list[tuple[int, int, Payload]],
                       recvs: list[tuple[int, int]], what: str
                       ) -> dict[int, bytes | memoryview]:
        """One step of point-to-point messages over the tier group (see ``Link.exchange``)."""
        return await asyncio.to_thread(self.link.exchange, sends, recvs, what)

    async def folders(self, store: Store) -> list[str]:
        """Names of the version folders ``store`` holds (:func:`version_folders`)."""
        return await version_folders(store, self.run)

    async def versions(self, store: Store) -> list[str]:
        """Versions whose manifest ``store`` holds (a node folder: one walk)."""
        keys = await store.list(self.run.versions_prefix)
        return sorted({k.split("/")[-2] for k in keys if k.endswith("/manifest.json")})


async def version_folders(store: Store, run: RunLayout) -> list[str]:
    """Names of the version folders of ``run`` that ``store`` holds, complete or not: one LIST
    with a delimiter (a remote bucket: one request per 1000 versions, no key of any blob)."""
    out = []
    for name in (await store.list_dir(run.versions_prefix)).dirs:
        with contextlib.suppress(InvalidFormat):
            out.append(version_id(version_number(name)))
    return sorted(out)
