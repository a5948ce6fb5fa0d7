"""The lossy tier inside the manager: what goes lossy, encoding with rollback, chain reads.

Why a module of its own: the manager only has to (1) split each staged item into the tensors
the lossy encoder takes and the rest, which stays in the lossless blobs, (2) write one MLDC
blob per version and rank, and (3) at restore, decode the lossy chain and put its tensors back
into the item trees. Everything about roles, eligibility, rollback and chain walking is here.

Names: a tensor of item ``model`` or ``optimizer`` is ``"<item>/<tensor>"`` (e.g.
``model/0.weight``, ``optimizer/state/0/exp_avg``); ``exact`` globs match these names. A model
parameter and its optimizer moments share a group (the parameter's name), found through the
live optimizer's ``param_groups`` — the same order ``Optimizer.state_dict()`` numbers them in.

Rollback: every lossy delta is coded against the previous *reconstruction*; a save that fails
or is cancelled must not become the next delta's base, so :class:`LossyTrack` keeps the
encoder's mark and rolls back unless the version commits.
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import asdict
from typing import Any

import torch
import xxhash

from mithril_async.codec.dtypes import as_torch
from mithril_async.config import LossyConfig
from mithril_async.errors import ChecksumMismatch, InvalidFormat, KeyNotFound, MissingPrevious
from mithril_async.live import LiveState
from mithril_async.lossy.excp import (
    LossyCheckpoint,
    LossyDeltaConfig,
    LossyDeltaDecoder,
    LossyDeltaEncoder,
    Role,
)
from mithril_async.lossy.serial import checkpoint_from_bytes, checkpoint_to_bytes
from mithril_async.manifest import (
    BaseRef,
    BlobRef,
    LossyEntry,
    ShardRef,
    VersionManifest,
    version_number,
)
from mithril_async.save.items import StagedItem
from mithril_async.storage.base import Store

__all__ = ["LossyTrack", "lossy_roles", "merge_lossy", "read_lossy_blob", "read_lossy_chain"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_CHAIN = 100_000
Roles = dict[str, tuple[str, Role]]


def delta_config(cfg: LossyConfig) -> LossyDeltaConfig:
    """The encoder configuration a ``[checkpointing.lossy]`` table stands for."""
    return LossyDeltaConfig(
        density=cfg.density, bits=cfg.bits, moment_bits=cfg.moment_bits,
        block_size=cfg.block_size, keyframe_every=cfg.keyframe_every, joint=cfg.joint,
        v_log=cfg.v_log, v_density=cfg.v_density, fisher_weighted=cfg.fisher_weighted,
        min_numel=cfg.min_numel, exact=tuple(cfg.exact), level=cfg.level,
        keyframe_mode=cfg.keyframe, keyframe_bits=cfg.keyframe_bits,
        keyframe_moment_bits=cfg.keyframe_moment_bits, error_rel=cfg.error_rel,
        v_error_rel=cfg.v_error_rel)


def lossy_roles(state: Mapping[str, Any]) -> Roles:
    """Roles of the model's parameters and their Adam moments, by ``"<item>/<tensor>"`` name.

    Only ``state["model"]`` (a module, or an item wrapping one: a
    :class:`~mithril_async.sharded.ShardedModel`) and ``state["optimizer"]`` (an optimizer
    or an item wrapping one; a ``ShardedOptimizer``'s state is keyed by parameter name) get
    roles (:class:`~mithril_async.live.Binding`); other items are never lossy."""
    live = state if isinstance(state, LiveState) else LiveState(state)
    model, opt = live.bindings.get("model"), live.bindings.get("optimizer")
    module = None if model is None else model.module
    if module is None:
        return {}
    names = {id(p): n for n, p in module.named_parameters()}
    roles: Roles = {f"model/{n}": (n, "param") for n in names.values()}
    if opt is None:
        return roles
    if opt.kind == "sharded":  # ShardedOptimizer: get_optimizer_state_dict keys by FQN
        for n in names.values():
            roles[f"optimizer/state/{n}/exp_avg"] = (n, "exp_avg")
            roles[f"optimizer/state/{n}/exp_avg_sq"] = (n, "exp_avg_sq")
        return roles
    optimizer = opt.optimizer
    if optimizer is None:
        return roles
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            pname = names.get(id(p))
            if pname is not None:
                roles[f"optimizer/state/{index}/exp_avg"] = (pname, "exp_avg")
                roles[f"optimizer/state/{index}/exp_avg_sq"] = (pname, "exp_avg_sq")
            index += 1
    return roles


def _decode_roles(names: list[str]) -> Roles:
    """Roles a reader needs (only exp_avg_sq's clamp depends on it), from the names alone."""
    out: Roles = {}
    for n in names:
        role: Role = ("exp_avg_sq" if n.endswith("/exp_avg_sq") else
                      "exp_avg" if n.endswith("/exp_avg") else "param")
        out[n] = (n, role)
    return out


class LossyTrack:
    """The encoder of one rank's lossy chain, and the last committed lossy blob."""

    def __init__(self, cfg: LossyConfig) -> None:
        self.cfg = cfg
        self.config = delta_config(cfg)
        self.encoder = LossyDeltaEncoder(self.config)
        self.base: BaseRef | None = None
        self._mark: tuple[dict[str, torch.Tensor], int, int] | None = None

    def eligible(self, full: str, t: torch.Tensor, roles: Roles) -> bool:
        """Lossy only for a float tensor with a role, big enough, and not marked exact.

        A pattern matching a parameter (``model/<name>``) keeps its optimizer moments exact
        too: an exact weight driven by lossy moments would not resume exactly either."""
        if full not in roles or t.dtype not in _FLOATS or t.numel() < self.cfg.min_numel:
            return False
        names = (full, f"model/{roles[full][0]}")
        return not any(fnmatch.fnmatchcase(n, p) for n in names for p in self.cfg.exact)

    def split(self, items: list[StagedItem], roles: Roles
              ) -> tuple[dict[str, torch.Tensor], list[StagedItem]]:
        """(lossy tensors by full name, the items without them). Never copies or mutates."""
        lossy: dict[str, torch.Tensor] = {}
        rest: list[StagedItem] = []
        for item in items:
            keep: dict[str, torch.Tensor] = {}
            for name, staged in item.tensors.items():
                full = f"{item.name}/{name}"
                t = as_torch(staged, where=full)
                if self.eligible(full, t, roles):
                    lossy[full] = t
                else:
                    keep[name] = staged
            rest.append(StagedItem(item.name, item.skeleton, keep, item.area_idx))
        return lossy, rest

    def encode(self, state: dict[str, torch.Tensor], roles: Roles) -> LossyCheckpoint:
        """Encode the next version (worker thread); pending until :meth:`commit`."""
        self._mark = self.encoder.mark()
        return self.encoder.encode(state, roles)

    def commit(self, ref: BaseRef) -> None:
        self.base, self._mark = ref, None

    def rollback(self) -> None:
        """Forget an encoded version that did not commit (idempotent)."""
        if self._mark is not None:
            self.encoder.rollback(self._mark)
            self._mark = None

    def reset(self) -> None:
        """After a restore the live state is no longer the chain's: start a new keyframe."""
        self.encoder.reset()
        self.base, self._mark = None, None

    def entry(self, ckpt: LossyCheckpoint, shard: ShardRef) -> LossyEntry:
        fields = ckpt.manifest_fields()["lossy"]
        params = {**asdict(self.config), "exact": list(self.config.exact)}
        return LossyEntry(keyframe=ckpt.keyframe, index=ckpt.index, params=params,
                          tensors=sorted(ckpt.records), quantized=sorted(fields["tensors"]),
                          shards=[shard])


async def write_lossy(store: Store, key: str, ckpt: LossyCheckpoint, base: BaseRef | None,
                      rank: int, pool: Executor, level: int) -> ShardRef:
    """Serialise and store one MLDC blob; the ref carries its chain base (None: keyframe)."""
    loop = asyncio.get_running_loop()
    data = await loop.run_in_executor(pool, checkpoint_to_bytes, ckpt, level)
    digest = await loop.run_in_executor(pool, xxhash.xxh64_hexdigest, data)
    await store.put(key, data)
    return ShardRef(key=key, bytes=len(data), xxh64=digest, format="mldc", rank=rank,
                    raw_bytes=ckpt.raw_bytes, base=None if ckpt.keyframe else base)


async def read_lossy_blob(store: Store, ref: BlobRef | BaseRef, size: int | None,
                          pool: Executor) -> LossyCheckpoint:
    """Fetch one MLDC blob, check its size (when given) and xxh64, and parse it.

    Parsing validates the whole container (its own trailing hash, every range, dtypes), so
    this is also how a reader that does not decode the chain (``mithril verify``) checks a
    lossy blob; :class:`~mithril_async.restore.fresh.FreshDecoder` reads lossless blobs only.
    """
    if size is not None:
        got_size = await store.size(ref.key)  # before reading: a huge file costs no memory
        if got_size != size:
            raise InvalidFormat(f"{ref.key}: {got_size} bytes, manifest says {size}")
    loop = asyncio.get_running_loop()
    data = await store.get(ref.key)
    digest = await loop.run_in_executor(pool, xxhash.xxh64_hexdigest, data)
    if digest != ref.xxh64:
        raise ChecksumMismatch(ref.key, ref.xxh64, digest)
    try:
        return await loop.run_in_executor(pool, checkpoint_from_bytes, data)
    except InvalidFormat as err:
        raise InvalidFormat(f"{ref.key}: {err}") from None


def _rank_shard(m: VersionManifest, rank: int) -> ShardRef:
    assert m.lossy is not None
    for s in m.lossy.shards:
        if s.rank == rank:
            return s
    raise MissingPrevious(f"{m.version_id} has no lossy blob for rank {rank}")


async def read_lossy_chain(store: Store, m: VersionManifest, rank: int, pool: Executor,
                           read_manifest: Callable[[str], Awaitable[VersionManifest]]
                           ) -> dict[str, torch.Tensor]:
    """Decode this rank's lossy tensors of version ``m`` (``"<item>/<tensor>"`` names).

    Walks the ``base`` links back to the chain's keyframe (each link verified: the base
    version must be older and hold a lossy blob with that key and xxh64), then decodes forward.
    ``read_manifest`` maps a version id to its manifest."""
    if m.lossy is None:
        return {}
    ref = _rank_shard(m, rank)
    links: list[ShardRef] = [ref]
    vid = m.version_id
    while ref.base is not None:
        base = ref.base
        if version_number(base.version_id) >= version_number(vid) or len(links) > _MAX_CHAIN:
            raise InvalidFormat(f"{ref.key}: lossy base {base.version_id} is not older than "
                                f"{vid}")
        try:
            holder = await read_manifest(base.version_id)
        except KeyNotFound:
            raise MissingPrevious(f"{m.version_id} needs lossy blob {base.key} from version "
                                  f"{base.version_id}, which is gone") from None
        found = None if holder.lossy is None else next(
            (s for s in holder.lossy.shards if s.key == base.key), None)
        if found is None or found.xxh64 != base.xxh64:
            raise MissingPrevious(f"{m.version_id} needs lossy blob {base.key} (xxh64 "
                                  f"{base.xxh64}) but version {base.version_id} holds "
                                  f"{'no such blob' if found is None else found.xxh64}")
        ref, vid = found, base.version_id
        links.append(ref)
    dec = LossyDeltaDecoder()
    loop = asyncio.get_running_loop()
    out: dict[str, torch.Tensor] = {}
    for link in reversed(links):
        try:
            ckpt = await read_lossy_blob(store, link, link.bytes, pool)
        except KeyNotFound:
            raise MissingPrevious(f"{m.version_id} needs lossy blob {link.key}, which is "
                                  "gone") from None
        roles = _decode_roles(list(ckpt.records))
        out = await loop.run_in_executor(pool, dec.decode, ckpt, roles)
    return out


def merge_lossy(item: str, tensors: dict[str, torch.Tensor],
                lossy: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put item ``item``'s lossy tensors back next to its lossless ones."""
    prefix = f"{item}/"
    for full, t in lossy.items():
        if full.startswith(prefix):
            tensors[full[len(prefix):]] = t
    return tensors
