"""Multi-tier checkpoints: node-local commit, peer replicas over torch.distributed, remote.

See :mod:`mithril_async.tiers.tiered` for how a save and a recovery flow through the tiers,
:mod:`mithril_async.tiers.topology` for the node and replica mapping, and docs/LAYOUT.md for
the folders and aliases."""

from mithril_async.tiers.config import TiersConfig, check_local_root
from mithril_async.tiers.tiered import (
    NodeStore,
    TierCoordinator,
    TierResult,
    Tiers,
    needed_files,
    owned_files,
    owner_of,
    resharded_files,
    restore_files,
)
from mithril_async.tiers.topology import NodeMap
from mithril_async.tiers.transport import GlooLink, LocalLink

__all__ = ["GlooLink", "LocalLink", "NodeMap", "NodeStore", "TierCoordinator", "TierResult",
           "Tiers", "TiersConfig", "check_local_root", "needed_files", "owned_files", "owner_of",
           "resharded_files", "restore_files"]
