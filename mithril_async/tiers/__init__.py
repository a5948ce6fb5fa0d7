"""Multi-tier checkpoints: node-local commit, peer replicas over torch.distributed, remote.

Set ``[checkpointing.tiers]`` (:class:`TiersConfig`) and the manager saves and restores through
the tiers (:mod:`mithril_async.tiers.layer` says how the parts fit; docs/LAYOUT.md the folders).
What users get back: ``SaveResult.tiers`` (a :class:`TierResult`) and, after a restore,
``manager.tiers.last_sources`` (a :class:`Source` per file).

Only light modules are imported here: :mod:`mithril_async.config` types its ``tiers`` field
with :class:`TiersConfig`.
"""

from mithril_async.tiers.config import TiersConfig
from mithril_async.tiers.results import TierResult
from mithril_async.tiers.sources import Place, Source
from mithril_async.tiers.topology import NodeMap

__all__ = ["NodeMap", "Place", "Source", "TierResult", "TiersConfig"]
