"""Which ranks share a node, and which rank holds the replica of which.

Nodes come from ``LOCAL_WORLD_SIZE`` (set by torchrun: ranks ``n*L .. n*L+L-1`` are node
``n``) or, when it is not set, from the hostnames every rank reports at start (nodes numbered
in order of their lowest rank). The replica mapping is fixed and documented so that a
restarted job finds the copies without any lookup: the ``k``-th replica (``k = 1..replicas``)
of rank ``r`` on node ``n`` with local rank ``l`` is held by local rank ``l`` of node
``(n + k) mod nodes`` (NVRx's "replication jump" of one node); when that node has fewer ranks,
by its local rank ``l mod size``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from mithril_async.errors import ConfigError


@dataclass(frozen=True)
class NodeMap:
    """``node_of[r]`` for every rank ``r`` of the job."""

    node_of: tuple[int, ...]

    @classmethod
    def from_local_world_size(cls, world: int, local_world_size: int) -> NodeMap:
        if local_world_size < 1 or world % local_world_size:
            raise ConfigError(f"LOCAL_WORLD_SIZE = {local_world_size} does not divide the "
                              f"world size {world}: cannot tell which ranks share a node")
        return cls(tuple(r // local_world_size for r in range(world)))

    @classmethod
    def from_hostnames(cls, hosts: Sequence[str]) -> NodeMap:
        ids: dict[str, int] = {}
        return cls(tuple(ids.setdefault(h, len(ids)) for h in hosts))

    @classmethod
    def from_env(cls, world: int, hosts: Sequence[str] | None = None) -> NodeMap:
        """``LOCAL_WORLD_SIZE`` if set, else the gathered hostnames, else one node."""
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        if lws is not None:
            try:
                n = int(lws)
            except ValueError:
                raise ConfigError(f"LOCAL_WORLD_SIZE = {lws!r} is not an integer") from None
            return cls.from_local_world_size(world, n)
        if hosts is not None:
            return cls.from_hostnames(hosts)
        return cls((0,) * world)

    @property
    def world(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def local_rank(self, rank: int) -> int:
        return self.ranks_on(self.node_of[rank]).index(rank)

    def is_lead(self, rank: int) -> bool:
        """The lowest rank of its node does the node's bookkeeping (aliases, retention)."""
        return self.local_rank(rank) == 0

    def replica_holders(self, rank: int, replicas: int) -> list[int]:
        """The ranks holding copies of ``rank``'s blobs, first replica first."""
        if replicas >= self.nodes and replicas > 0:
            raise ConfigError(f"checkpointing.tiers.replicas = {replicas} needs at least "
                              f"{replicas + 1} nodes; this job has {self.nodes}")
        node, local = self.node_of[rank], self.local_rank(rank)
        out = []
        for k in range(1, replicas + 1):
            peers = self.ranks_on((node + k) % self.nodes)
            out.append(peers[local % len(peers)])
        return out

    def replicated_by(self, holder: int, replicas: int) -> list[int]:
        """The ranks whose blobs ``holder`` keeps a copy of."""
        return [r for r in range(self.world) if holder in self.replica_holders(r, replicas)]
