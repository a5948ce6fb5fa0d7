"""PyTorch Distributed Checkpoint (DCP) planners that store every tensor compressed.

Usage (single process or any number of ranks)::

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path),
             planner=MithrilSavePlanner(compression_level=3))
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=MithrilLoadPlanner())

Why the planner route works with DCP's stock ``FileSystemWriter``/``FileSystemReader``: a
storage writer copies the bytes of a ``BYTE_IO`` item verbatim, and a reader hands a ``BYTE_IO``
item's bytes to ``planner.load_bytes``. So global planning runs on ordinary tensor items (the
checkpoint's ``.metadata`` still describes real tensors and chunks, so dedup of replicated
tensors and resharding on load keep working); only in ``finish_plan``, after the global plan is
fixed, does the save planner turn each tensor item into a ``BYTE_IO`` item whose
``resolve_data`` returns an MCKP blob of that tensor chunk (byte grouping + zstd, chunks coded
in parallel). The load planner does the mirror image: its tensor read items become ``BYTE_IO``
items and ``load_bytes`` decodes, narrows to the requested slice and copies into the
destination tensor. Items are self-describing (a 4-byte magic), so the load planner also reads
plain DCP checkpoints (``torch.save`` items), and a checkpoint mixing both.

Tiny tensors (under :data:`RAW_BELOW` bytes) are stored as ``MRAW`` + xxh64 + raw bytes:
the MCKP header and trailer (~450 bytes) would cost more than compression saves; the dtype and
shape come from the checkpoint's own metadata.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.dtypes import dtype_name, tensor_bytes, tensor_from_bytes
from mithril_async.codec.state_dict import compress_state_dict, decompress_state_dict
from mithril_async.errors import ChecksumMismatch, InvalidFormat

__all__ = ["RAW_BELOW", "MithrilLoadPlanner", "MithrilSavePlanner", "decode_item",
           "encode_tensor"]

MCKP_MAGIC = b"MCKP"
RAW_MAGIC = b"MRAW"
_RAW_HEAD = struct.Struct("<4sQ")  # magic, xxh64 of the raw bytes
#: tensors smaller than this many bytes are stored raw (compression cannot pay for its header)
RAW_BELOW = 4096


def encode_tensor(t: torch.Tensor, *, name: str = "t", params: CodecParams | None = None,
                  threads: int | None = None) -> bytes:
    """One tensor (chunk) as DCP item bytes: an MCKP blob, or ``MRAW`` for tiny tensors."""
    t = t.detach().cpu().contiguous()
    p = params or CodecParams()
    if t.numel() * t.element_size() < RAW_BELOW:
        raw, _, _ = tensor_bytes(t, where=name)
        return _RAW_HEAD.pack(RAW_MAGIC, xxhash.xxh64_intdigest(raw.data)) + raw.tobytes()
    return compress_state_dict({name: t}, params=p, threads=threads)


def decode_item(data: bytes | memoryview, *, where: str, dtype: torch.dtype | None = None,
                shape: torch.Size | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`; plain ``torch.save`` items are loaded too.

    ``dtype``/``shape`` (from the DCP metadata) are needed only for ``MRAW`` items.
    """
    mv = memoryview(data).cast("B")
    magic = bytes(mv[:4])
    if magic == MCKP_MAGIC:
        tensors = decompress_state_dict(mv)
        if len(tensors) != 1:
            raise InvalidFormat(f"{where}: expected one tensor in the item, got {len(tensors)}")
        out: torch.Tensor = next(iter(tensors.values()))
        return out
    if magic == RAW_MAGIC:
        if dtype is None or shape is None:
            raise InvalidFormat(f"{where}: raw item but no tensor metadata to interpret it")
        if len(mv) < _RAW_HEAD.size:
            raise InvalidFormat(f"{where}: truncated raw item ({len(mv)} bytes)")
        _, digest = _RAW_HEAD.unpack(mv[:_RAW_HEAD.size])
        payload = mv[_RAW_HEAD.size:]
        got = xxhash.xxh64_intdigest(payload)
        if got != digest:
            raise ChecksumMismatch(where, f"{digest:016x}", f"{got:016x}")
        buf = np.frombuffer(payload, np.uint8).copy()
        return tensor_from_bytes(buf, dtype_name(dtype), tuple(shape), where=where)
    loaded = torch.load(io.BytesIO(bytes(mv)), map_location="cpu", weights_only=True)
    if not isinstance(loaded, torch.Tensor):
        raise InvalidFormat(f"{where}: item is neither a mithril blob nor a saved tensor")
    return loaded


class MithrilSavePlanner(DefaultSavePlanner):
    """A :class:`DefaultSavePlanner` whose tensor items are written compressed (lossless)."""

    def __init__(self, compression_level: int = 3, *, byte_grouping: bool = True,
                 chunk_mib: float = 4.0, threads: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.params = CodecParams(level=compression_level, byte_grouping=byte_grouping,
                                  chunk_bytes=max(1, int(chunk_mib * (1 << 20))))
        self.threads = threads
        self._compressed: set[MetadataIndex] = set()

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        items: list[WriteItem] = []
        for item in plan.items:
            if item.type in (WriteItemType.TENSOR, WriteItemType.SHARD):
                # keep tensor_data: the writer buckets by it, and it documents the item
                item = dataclasses.replace(item, type=WriteItemType.BYTE_IO)
                self._compressed.add(item.index)
            items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.index not in self._compressed:
            return super().resolve_data(write_item)
        tensor = self.lookup_object(write_item.index)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidFormat(f"{write_item.index.fqn}: planned as a tensor, found "
                                f"{type(tensor).__name__}")
        return io.BytesIO(encode_tensor(tensor, name=write_item.index.fqn, params=self.params,
                                        threads=self.threads))


class MithrilLoadPlanner(DefaultLoadPlanner):
    """A :class:`DefaultLoadPlanner` that reads what :class:`MithrilSavePlanner` wrote."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tensor_items: set[ReadItem] = set()

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        items: list[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                item = dataclasses.replace(item, type=LoadItemType.BYTE_IO)
                self._tensor_items.add(item)
            items.append(item)
        return dataclasses.replace(plan, items=items)

    def _chunk_meta(self, index: MetadataIndex) -> tuple[torch.dtype | None, torch.Size | None]:
        md = self.metadata.state_dict_metadata.get(index.fqn) if self.metadata else None
        if not isinstance(md, TensorStorageMetadata):
            return None, None
        for chunk in md.chunks:
            if index.offset is None or tuple(chunk.offsets) == tuple(index.offset):
                return md.properties.dtype, chunk.sizes
        return md.properties.dtype, None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if read_item not in self._tensor_items:
            super().load_bytes(read_item, value)
            return
        where = f"{read_item.storage_index.fqn}@{tuple(read_item.storage_index.offset or ())}"
        dtype, shape = self._chunk_meta(read_item.storage_index)
        tensor = decode_item(value.getbuffer(), where=where, dtype=dtype, shape=shape)
        tensor = narrow_tensor_by_index(tensor, read_item.storage_offsets, read_item.lengths)
        target = self.resolve_tensor(read_item).detach()
        if target.size() != tensor.size():
            raise InvalidFormat(f"{where}: stored slice {tuple(tensor.size())} does not fit "
                                f"destination {tuple(target.size())}")
        target.copy_(tensor)
        self.commit_tensor(read_item, target)
