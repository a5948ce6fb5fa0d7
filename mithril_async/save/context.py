"""What the saves of one manager share, and hand from one save to the next.

A :class:`SaveContext` lives as long as its manager and holds what one save hands to the next:
the delta chains with their staging buffers, the lossy track, the steps already committed, the
slot ring of streamed saves. Everything that belongs to one save alone lives on its
:class:`~mithril_async.save.job.SaveJob`, so no save leaves state behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mithril_async.catalog import RunCatalog
from mithril_async.config import Config
from mithril_async.layout import RunLayout
from mithril_async.manifest import BlobRef, version_id
from mithril_async.memory.budget import HostBudget
from mithril_async.pipeline.pool import CodecPool
from mithril_async.retention import Policy
from mithril_async.save.buffers import BufferSet
from mithril_async.save.coordinator import Coordinator
from mithril_async.save.results import SaveResult
from mithril_async.save.writers import BlobEncoder
from mithril_async.save.xor_chain import ChainPolicy, ItemChain
from mithril_async.storage.base import Store
from mithril_async.storage.capabilities import local_root

if TYPE_CHECKING:
    from mithril_async.memory.ring import SlotRing
    from mithril_async.pipeline.lossy import LossyTrack

__all__ = ["SaveContext", "staging_area"]

log = logging.getLogger("mithril_async")


def staging_area() -> BufferSet:
    """A training process's buffer set: host buffers the live state is copied into (torch is
    imported here, not with this module: a checkpoint worker never makes one)."""
    from mithril_async.save.staging import StagingArea

    return StagingArea()


@dataclass
class SaveContext:
    """What the saves of one manager share, and hand from one save to the next."""

    config: Config
    state: Mapping[str, Any]
    store: Store
    layout: RunLayout
    catalog: RunCatalog
    coordinator: Coordinator
    pool: CodecPool
    encoder: BlobEncoder
    chain_policy: ChainPolicy
    #: what survives retention (None: everything); built once from the config or injected
    retention: Policy | None
    #: each rank saves its own model shard (FSDP/DTensor) instead of rank 0 the whole model
    sharded_model: bool = False
    #: the opt-in lossy tier ([checkpointing.lossy]); None keeps the lossless path as is
    lossy: LossyTrack | None = None
    #: per item: its staging buffers and delta chain, made at its first save
    chains: dict[str, ItemChain] = field(default_factory=dict)
    history: list[SaveResult] = field(default_factory=list)
    on_save: Callable[[SaveResult], None] | None = None
    #: steps committed in this run (known once the manager has started)
    steps: set[int] | None = None
    #: the run's config/train.toml as recorded by every manifest (written once per run)
    config_ref: BlobRef | None = None
    lossy_idle_warned: bool = False
    #: the slot ring of streamed saves (host_memory_mib), reused while its size fits
    ring: SlotRing | None = None
    #: where that ring's slots are allocated (None: private host memory; shared memory when
    #: a worker process encodes the chunks the trainer copies into them)
    ring_alloc: Callable[..., Any] | None = None
    #: makes an item's staging buffer set: a trainer's copies the live state in
    #: (:func:`staging_area`, in shared memory when a worker process encodes); a checkpoint
    #: worker's only holds what its trainer staged (:class:`BufferSet`)
    new_area: Callable[[], BufferSet] = staging_area

    @classmethod
    def for_run(cls, config: Config, state: Mapping[str, Any], store: Store, layout: RunLayout,
                catalog: RunCatalog, coordinator: Coordinator, pool: CodecPool, *,
                retention: Policy | None, sharded_model: bool = False,
                **kw: Any) -> SaveContext:
        """What the saves of a run share, built from its configuration: the one builder of
        the training process (a manager) and of its checkpoint worker (``kw``: the other
        fields, e.g. the worker's ``new_area``)."""
        cfg = config.checkpointing
        ctx = cls(config=config, state=state, store=store, layout=layout, catalog=catalog,
                  coordinator=coordinator, pool=pool,
                  encoder=BlobEncoder(cfg.compression, cfg.pipeline, pool),
                  chain_policy=ChainPolicy.of(cfg.compression), retention=retention,
                  sharded_model=sharded_model, **kw)
        if cfg.lossy.enabled:  # imported here: the lossy coder works on torch tensors
            from mithril_async.pipeline.lossy import LossyTrack

            ctx.lossy = LossyTrack(cfg.lossy)
        return ctx

    def __post_init__(self) -> None:
        remote = self.config.checkpointing.remote
        if remote is not None:  # an S3 upload buffers parts (storage/s3/writer.py)
            self.encoder.budget.write_buffer_bytes += (remote.max_concurrency + 2) * (
                remote.part_mib << 20)

    @property
    def memory(self) -> HostBudget:
        return self.encoder.memory

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def root_local(self) -> str | None:
        return local_root(self.store)

    def root_remote(self) -> str | None:
        r = self.config.checkpointing.remote
        return None if r is None else f"s3://{r.bucket}/{r.prefix}".rstrip("/")

    def whole_model(self, name: str) -> bool:
        """Whether item ``name`` is the unsharded model, which rank 0 alone writes."""
        return name == "model" and not self.sharded_model

    def chain(self, name: str) -> ItemChain:
        chain = self.chains.get(name)
        if chain is None:  # once per item: its staging buffers live in the chain
            sets = 2 if self.chain_policy.double_buffer else 1
            chain = self.chains[name] = ItemChain(
                self.chain_policy, [self.new_area() for _ in range(sets)])
        return chain

    async def discard(self, number: int) -> None:
        """Remove what an aborted save left in its version folder: rank 0 everything in it,
        any other rank its own files (every rank listing and deleting every rank's files
        would cost the store ranks x ranks requests). What a rank cannot remove (temp files,
        another rank's files when rank 0 is gone) the next start's cleanup removes."""
        try:
            if self.rank != 0:
                errors = await self.catalog.delete_keys(
                    [self.layout.shard_key(number, name, self.rank) for name in self.state]
                    + [self.layout.rng_key(number, self.rank),
                       self.layout.lossy_key(number, self.rank)])
                if errors:
                    raise errors[0]
                return
            keys = await self.store.list(self.layout.version_dir(number) + "/")
            # a manifest that landed before its commit failed goes first: never a manifest
            # without its blobs, even if this cleanup is cut short
            manifest = self.layout.manifest_key(number)
            if manifest in keys:
                await self.store.delete(manifest)
            errors = await self.catalog.delete_keys(k for k in keys if k != manifest)
            if errors:
                raise errors[0]
        except Exception as err:  # the next start cleans what remains
            log.warning("could not clean aborted version %s: %r", version_id(number), err)
