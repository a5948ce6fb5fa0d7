"""What a version holds of one state item, as whole (global) tensors, read a group at a time.

An export needs the item's tensors in the order of its state dict, with their global shapes
and saved dtypes, before it reads any of them (to plan its output files), and then the full
tensors of one group at a time, so that memory stays at one group plus the restore's
in-flight budget whatever the model's size. Both come from the one restore path:

- a **sharded** item (``ShardedModel`` / ``ShardedOptimizer``: FSDP2, tensor parallel) lists
  its tensors from the shard metadata every rank recorded (``ShardRef`` pieces) and the
  lowest rank's state skeleton; a group is read as a restore into full-size targets (a
  :class:`~mithril_async.sharded.ShardTarget` whose box is the whole global tensor):
  :func:`~mithril_async.restore.plan.pieces_read` plans which saved pieces cover them,
  :func:`~mithril_async.restore.execute.open_item` / ``write_item`` stream only the chunks
  holding them, every block verified by its own hashes;
- an **unsharded** item (rank 0's whole model) is the same with one saved piece per tensor,
  the whole tensor: the listing comes from its blob's header (for tensors a delta blob only
  references, from the header of the blob holding them);
- a **lossy** item decodes only along its chain, whole: it is read once through
  :meth:`~mithril_async.restore.reader.VersionReader.read_version` and held (its size, not
  a group's, bounds the memory). A sharded lossy item is refused (its chain is per rank).

Names: a tensor's stored name is its '/'-joined path in the state tree; its exported name
is the path joined with '.' (a flat ``state_dict()`` keeps its own keys), as
:func:`~mithril_async.integrations.safetensors_file.flatten_tensors` names them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mithril_async.catalog import RunCatalog
from mithril_async.codec.container_read import AsyncMckpRangeReader
from mithril_async.codec.formats import blob_format
from mithril_async.errors import (
    ChecksumMismatch,
    DistributedError,
    InvalidFormat,
    MissingPrevious,
    UnsupportedStateType,
    VersionNotFound,
)
from mithril_async.manifest import PieceMeta, ShardRef, VersionManifest, version_number
from mithril_async.pipeline.blobs import REFS_KEY, TensorRef, skeleton_of
from mithril_async.restore.execute import Progress, open_item, write_item
from mithril_async.restore.plan import per_rank_items, pieces_read
from mithril_async.restore.reader import VersionReader
from mithril_async.restore.reshard import Box
from mithril_async.restore.sources import check_size, open_safetensors
from mithril_async.sharded import ShardTarget
from mithril_async.state import TORCH_DTYPES, flatten_state
from mithril_async.storage.base import Store

__all__ = ["ItemTensors", "TensorSpec", "open_item_tensors", "tensor_paths"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an item: its stored name, exported name, saved dtype, global shape."""

    stored: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def tensor_paths(skeleton: Any) -> list[tuple[str, str]]:
    """``(stored name, exported name)`` of every tensor of a state skeleton, in the tree's
    order; exported names join the path with '.' and must be unique and non-empty."""
    out: list[tuple[str, str]] = []

    def key(k: Any) -> str:
        return k if isinstance(k, str) else json.dumps(k) if isinstance(k, dict) else str(k)

    def walk(x: Any, path: str) -> None:
        if not isinstance(x, dict):
            return
        leaf = x.get("T", x.get("N"))
        if isinstance(leaf, str):
            out.append((leaf, path))
        elif "D" in x:
            for k, v in x["D"]:
                walk(v, f"{path}.{key(k)}" if path else key(k))
        elif "L" in x or "U" in x:
            for i, v in enumerate(x.get("L") or x.get("U") or []):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(skeleton, "")
    seen: dict[str, str] = {}
    for stored, name in out:
        if not name:
            raise UnsupportedStateType(f"tensor {stored!r} is the whole state: a safetensors "
                                       "file needs a name for it")
        if name in seen:
            raise UnsupportedStateType(f"tensors {seen[name]!r} and {stored!r} would both be "
                                       f"named {name!r} in a safetensors file")
        seen[name] = stored
    return out


def _torch_dtype(name: str, where: str) -> torch.dtype:
    dt = TORCH_DTYPES.get(name)
    if dt is None:
        raise InvalidFormat(f"{where}: unknown dtype {name!r}")
    return dt


def _empty(spec: TensorSpec) -> torch.Tensor:
    """A contiguous CPU tensor for ``spec`` whose memory numpy allocates (so it is accounted
    where Python's allocations are traced)."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    buf = np.empty(spec.numel * itemsize, np.uint8)
    return torch.from_numpy(buf).view(spec.dtype).reshape(spec.shape)


@dataclass
class ItemTensors:
    """The tensors of one item of one version (:attr:`specs`, in state-dict order), read a
    group at a time by :meth:`read` (module docstring)."""

    reader: VersionReader
    manifest: VersionManifest
    item: str
    specs: list[TensorSpec]
    #: saved rank -> its blob of the item, each with the pieces it holds
    refs: dict[int, ShardRef]
    #: a lossy item, decoded whole once (stored name -> tensor); None otherwise
    whole: dict[str, torch.Tensor] | None = None

    async def read(self, group: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """The full tensors of ``group`` (by stored name), in their saved dtypes; every
        saved piece of them read and verified, or an error (nothing partial is returned)."""
        if self.whole is not None:
            return {s.stored: self.whole[s.stored] for s in group}
        out = {s.stored: _empty(s) for s in group}
        targets = {s.stored: ShardTarget(out[s.stored], out[s.stored],
                                         Box.of([0] * len(s.shape), s.shape), s.shape, s.dtype)
                   for s in group}
        plan = pieces_read(self.item, self.refs, targets)
        m = self.manifest
        # a loader per group: the delta bases it decodes are dropped with the group
        ctx = self.reader.resources(m.version_id)
        opened = await open_item(ctx, plan, m.version_id, m.step, "block", ctx.inflight)
        await write_item(ctx, opened, Progress(), ctx.inflight)
        return out


async def open_item_tensors(reader: VersionReader, m: VersionManifest, item: str
                            ) -> ItemTensors:
    """List ``item`` of version ``m`` (nothing but headers read): see the module docstring.
    :class:`VersionNotFound` when the version has no such item; a sharded item without
    shard metadata, or a lossy sharded one, is :class:`DistributedError`."""
    refs, sharded = _saved_refs(m, item)
    lossy = m.lossy is not None and any(t.startswith(f"{item}/") for t in m.lossy.tensors)
    if lossy:
        if sharded:
            raise DistributedError(
                f"{m.version_id}: {item} holds lossy tensors, which decode only along each "
                f"rank's chain; restore it on {m.world_size} rank(s) and save it from there")
        key = reader.catalog.layout.manifest_key(version_number(m.version_id))
        got = await reader.read_version(key, items={item}, rng=False)
        skeleton, tensors = flatten_state(got.trees[item])
        specs = [TensorSpec(s, n, tensors[s].dtype, tuple(tensors[s].shape))
                 for s, n in tensor_paths(skeleton)]
        return ItemTensors(reader, m, item, specs, refs, whole=tensors)
    first = refs[min(refs)]
    skeleton, saved = await _head(reader.catalog, first)
    if sharded:
        saved = {n: (p.dtype, tuple(p.global_shape)) for n, p in first.piece_table().items()}
    paths = tensor_paths(skeleton)
    _check_listing(first.key, [s for s, _ in paths], saved)
    specs = [TensorSpec(s, n, _torch_dtype(saved[s][0], f"{first.key}: tensor {s!r}"),
                        saved[s][1]) for s, n in paths]
    if not sharded:  # one piece per tensor: the whole of it
        refs = {first.rank: first.model_copy(update={"pieces": {
            s.stored: PieceMeta(global_shape=list(s.shape), offsets=[0] * len(s.shape),
                                lengths=list(s.shape), dtype=saved[s.stored][0])
            for s in specs}})}
    return ItemTensors(reader, m, item, specs, refs)


def _saved_refs(m: VersionManifest, item: str) -> tuple[dict[int, ShardRef], bool]:
    """The blobs of ``item`` by saved rank, and whether they are shards to consolidate."""
    shards = per_rank_items(m, {item}).get(item)
    if shards is None:
        if item != "model" or m.model is None:
            raise VersionNotFound(f"{m.version_id} has no {item!r} state (it has: "
                                  f"{', '.join(m.item_names())})")
        return {0: ShardRef(**m.model.model_dump(), rank=0)}, False
    by_rank = {s.rank: s for s in sorted(shards, key=lambda s: s.rank)}
    if all(s.has_pieces for s in shards) and len({s.piece_names() for s in shards}) == 1:
        return by_rank, True
    if len(shards) == 1:
        return by_rank, False
    raise DistributedError(
        f"{m.version_id}: {item} was saved by {len(shards)} ranks without shard metadata "
        "(placements that are no box, or state that is not sharded), so it cannot be "
        "consolidated into full tensors")


async def _head(catalog: RunCatalog, ref: ShardRef) -> tuple[Any, dict[str, tuple[str,
                                                                                 tuple[int, ...]]]]:
    """The state skeleton of blob ``ref`` and ``{stored name: (dtype, shape)}`` of every
    tensor it holds or references, from its header (each part checked by its own hash)."""
    store = catalog.store
    await check_size(store, ref)
    if not blob_format(ref.format, ref.key).block_hashes:  # safetensors
        st = await open_safetensors(store, ref)
        return st.skeleton, {e.name: (e.dtype, e.shape) for e in st.entries}
    info = await _mckp_header(store, ref.key, ref.bytes)
    saved = {t.name: (t.dtype, tuple(t.shape)) for t in info.tensors}
    raw = info.metadata.get(REFS_KEY) or {}
    if not isinstance(raw, dict):
        raise InvalidFormat(f"{ref.key}: malformed tensor references")
    for name, tref in ((n, TensorRef.from_json(r, ref.key)) for n, r in raw.items()):
        holder = tref.holder.key
        if not catalog.layout.owns(holder):
            raise InvalidFormat(f"{ref.key}: tensor {name!r} lives in {holder}, outside its run")
        try:
            entries = {t.name: t for t in (await _mckp_header(
                store, holder, await store.size(holder))).tensors}
        except FileNotFoundError:
            raise MissingPrevious(f"{ref.key}: tensor {name!r} lives in {holder}, which is "
                                  "gone") from None
        if tref.name not in entries:
            raise MissingPrevious(f"{ref.key}: tensor {name!r} is not in {holder}")
        saved[name] = (entries[tref.name].dtype, tuple(entries[tref.name].shape))
    return skeleton_of(info.metadata, ref.key), saved


async def _mckp_header(store: Store, key: str, size: int) -> Any:
    async def read_range(offset: int, length: int) -> bytes:
        return await store.get_range(key, offset, length)

    try:
        return await AsyncMckpRangeReader(read_range, size).open()
    except ChecksumMismatch as err:  # name the blob: the piece's own message cannot
        raise ChecksumMismatch(f"{key}: {err.where}", err.expected, err.actual) from None
    except InvalidFormat as err:
        raise type(err)(f"{key}: {err}") from None


def _check_listing(key: str, in_skeleton: Sequence[str],
                   saved: Mapping[str, Any]) -> None:
    """The skeleton names exactly the tensors the blob (or its pieces) holds."""
    missing = [n for n in in_skeleton if n not in saved]
    extra = sorted(set(saved) - set(in_skeleton))
    if missing or extra:
        raise InvalidFormat(f"{key}: the state skeleton and the stored tensors disagree "
                            f"(not stored: {missing[:5]}, not in the skeleton: {extra[:5]})")

