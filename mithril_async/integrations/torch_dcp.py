"""PyTorch Distributed Checkpoint (DCP) planners that store every tensor compressed.

Usage (single process or any number of ranks)::

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path),
             planner=MithrilSavePlanner(compression_level=3))
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=MithrilLoadPlanner())
    dcp.load(sd, checkpoint_id=path)                     # DCP's default planner reads it too
    dcp_to_torch_save(path, "model.pt")                  # one torch.save file (ours or torch's)

The constructors take :class:`DefaultSavePlanner` / :class:`DefaultLoadPlanner`'s positional
arguments in the same order (``MithrilSavePlanner(False)`` is ``flatten_state_dict=False``, as
it is for the default planner a user ports from); our options are keyword-only.

Why the planner route works with DCP's stock ``FileSystemWriter``/``FileSystemReader``: a
storage writer copies the bytes of a ``BYTE_IO`` item verbatim. So global planning runs on
ordinary tensor items (the checkpoint's ``.metadata`` still describes real tensors and chunks,
so dedup of replicated tensors and resharding on load keep working); only in ``finish_plan``,
after the global plan is fixed, does the save planner turn each tensor item into a ``BYTE_IO``
item whose ``resolve_data`` returns that tensor chunk compressed.

How DCP's own readers read our items (the supported hooks, no monkeypatching): an item is a
genuine ``torch.save`` file (a zip) whose only storage is the MCKP blob of the chunk (byte
grouping + zstd, chunks coded in parallel, every chunk hashed) and whose pickle is one call,
``mithril_compressed_tensor(blob, 1)``. That function is registered with
``torch.serialization.add_safe_globals`` when this module is imported, so the
``torch.load(..., weights_only=True)`` that DCP's default read path runs on a tensor item calls
it and gets the decoded tensor. The checkpoint's ``.metadata`` (which DCP reads with plain
``pickle``) is a :class:`MithrilMetadata`, so reading it imports this module: the default
``dcp.load`` planner and torch's ``format_utils.dcp_to_torch_save`` then read our checkpoints
unchanged wherever mithril_async is installed. Where it is not, unpickling ``.metadata`` fails
with ``No module named 'mithril_async'``; an item loaded with ``torch.load`` without this
module imported fails naming ``mithril_async.integrations.torch_dcp.mithril_compressed_tensor``.
Items of checkpoints written before this layout (a bare ``MCKP`` blob, or ``MRAW`` + xxh64 +
raw bytes for tiny tensors) carry no such hook: the default planner fails to unpickle them;
:class:`MithrilLoadPlanner` and :func:`dcp_to_torch_save` here read them.

Tiny tensors (under ``raw_below`` bytes, default :data:`RAW_BELOW`) stay ordinary DCP tensor
items: compression cannot pay for its header there. ``raw_below=0`` compresses every tensor.

**Decoded sizes are bounded before anything is allocated.** An MCKP blob may legitimately
declare far more bytes than it holds (a constant plane is one byte), and any process that
imported this module lets every ``torch.load(weights_only=True)`` call the decoder, so a
planted 2 KB item could otherwise demand a GiB. Where the checkpoint's metadata is at hand
(:class:`MithrilLoadPlanner`, :func:`decode_item` given ``dtype``/``shape``) the item must hold
exactly the dtype and shape of its stored chunk, which must lie inside the tensor's size (the
size DCP checks against the live tensor), and its pickle may decode one blob. Where it is not
(DCP's default read path, any other ``torch.load``), the bytes decoded from one blob, over
every call that passes it, are at most :data:`MAX_ITEM_RATIO` times the blob's size;
:func:`encode_tensor` never writes an item beyond that. Anything more is an
:class:`InvalidFormat` naming the item, raised before decoding.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import os
import pickle
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.container import BLOCK_FIXED, HASH, INDEX_ENTRY, PLANE, TensorEntry
from mithril_async.codec.dtypes import dtype_name, tensor_from_bytes
from mithril_async.codec.state_dict import compress_state_dict, decode_tensors, read_info
from mithril_async.errors import ChecksumMismatch, InvalidFormat

__all__ = ["MAX_ITEM_RATIO", "RAW_BELOW", "MithrilLoadPlanner", "MithrilMetadata",
           "MithrilSavePlanner", "dcp_to_torch_save", "decode_item", "encode_tensor",
           "mithril_compressed_tensor"]

MCKP_MAGIC = b"MCKP"
RAW_MAGIC = b"MRAW"
ZIP_MAGIC = b"PK\x03\x04"
_RAW_HEAD = struct.Struct("<4sQ")  # magic, xxh64 of the raw bytes (items of older versions)
#: tensors smaller than this many bytes stay plain DCP items (compression cannot pay for its
#: header and the torch.save wrapper)
RAW_BELOW = 4096
#: the layout of an item's ``torch.save`` wrapper (the second argument of the call)
_ITEM_LAYOUT = 1
#: without the checkpoint's metadata, one blob may decode to at most this many bytes per byte
#: it holds (over every call that passes it); more is refused before anything is allocated
MAX_ITEM_RATIO = 1 << 16
#: the fewest bytes one chunk costs in a blob: a block header with one plane, its hash, a
#: one-byte payload and its index entry. Chunks of at most MAX_ITEM_RATIO times this keep a
#: blob within the ratio, whatever the tensor holds.
_MIN_CHUNK_COST = BLOCK_FIXED.size + PLANE.size + HASH.size + 1 + INDEX_ENTRY.size
#: the chunk size an item is coded again with when its first coding exceeds the ratio (only a
#: near-constant tensor coded in chunks larger than this can)
_RATIO_SAFE_CHUNK = 4 << 20
assert _RATIO_SAFE_CHUNK <= MAX_ITEM_RATIO * _MIN_CHUNK_COST


def mithril_compressed_tensor(blob: object, layout: object) -> torch.Tensor:
    """Decode one DCP item written by :class:`MithrilSavePlanner` (the function its pickle calls).

    Registered as a ``weights_only`` safe global: it only decodes bytes (every chunk hashed,
    sizes validated by the MCKP reader, the decoded size bounded before allocating: see the
    module docs), so allowing it lets no pickle run anything else or allocate more than the
    file accounts for."""
    expected = _EXPECTED.get()  # set by decode_item, which knows the item's name
    where = expected.where if expected is not None else "mithril_async DCP item"
    if layout != _ITEM_LAYOUT:
        raise InvalidFormat(f"{where}: unknown layout {layout!r} (this "
                            f"mithril_async reads layout {_ITEM_LAYOUT}; upgrade it)")
    if not (isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 and blob.dim() == 1
            and blob.device.type == "cpu" and blob.is_contiguous()):
        # (a view of one byte repeated, stride 0, would be copied out at its full length)
        raise InvalidFormat(f"{where}: the payload is not a contiguous 1-D uint8 CPU tensor")
    data = blob.numpy().data.cast("B")
    if bytes(data[:4]) != MCKP_MAGIC:
        raise InvalidFormat(f"{where}: the payload is not an MCKP blob")
    if expected is not None:
        return _decode_mckp(data, where=where, admit=expected.admit)
    storage = blob.untyped_storage()
    return _decode_mckp(data, where=where, admit=lambda entry, where: _charge(
        entry, where, size=storage.nbytes(), storage=storage))


torch.serialization.add_safe_globals([mithril_compressed_tensor])


class _Packed:
    """Pickles as ``mithril_compressed_tensor(blob, layout)`` (``torch.save`` of an item)."""

    def __init__(self, blob: torch.Tensor) -> None:
        self.blob = blob

    def __reduce__(self) -> tuple[Any, tuple[torch.Tensor, int]]:
        return mithril_compressed_tensor, (self.blob, _ITEM_LAYOUT)


@dataclasses.dataclass
class MithrilMetadata(Metadata):
    """DCP's :class:`Metadata`, unchanged, under this module's name.

    DCP unpickles ``.metadata`` with plain ``pickle`` before reading any item, so the class
    name imports this module, which registers :func:`mithril_compressed_tensor` with
    ``torch.load``'s weights-only unpickler: DCP's default readers then decode our items."""


class _Expected:
    """What the checkpoint's metadata says one item holds: the item's blob must declare exactly
    this dtype and shape, and only one blob may be decoded for it."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int], where: str) -> None:
        self.where = where
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.used = False

    def admit(self, entry: TensorEntry, where: str) -> None:
        if self.used:
            raise InvalidFormat(f"{where}: the item decodes more than one blob")
        self.used = True
        want = dtype_name(self.dtype, where=where)
        if (entry.dtype, entry.shape) != (want, self.shape):
            raise InvalidFormat(f"{where}: the item declares {entry.dtype} {list(entry.shape)}, "
                                f"the checkpoint's metadata says {want} {list(self.shape)}")


#: set by :func:`decode_item` while ``torch.load`` runs an item's pickle with metadata at hand
_EXPECTED: contextvars.ContextVar[_Expected | None] = contextvars.ContextVar(
    "mithril_dcp_expected", default=None)
#: decoded bytes charged to each live blob storage (a pickle may pass one blob many times)
_SPENT: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_SPENT_LOCK = threading.Lock()


def _charge(entry: TensorEntry, where: str, *, size: int, storage: object = None) -> None:
    """Refuse ``entry`` when it, with what was decoded from ``storage`` before, exceeds
    :data:`MAX_ITEM_RATIO` times the blob's ``size``; else charge it to ``storage``."""
    with _SPENT_LOCK:
        spent = entry.nbytes + (_SPENT.get(storage, 0) if storage is not None else 0)
        if spent > size * MAX_ITEM_RATIO:
            raise InvalidFormat(
                f"{where}: a {size}-byte blob declares {spent} decoded bytes, more than "
                f"{MAX_ITEM_RATIO} times its size (no item this module writes does); refused "
                "before decoding. MithrilLoadPlanner bounds items by the checkpoint's metadata "
                "instead")
        if storage is not None:
            _SPENT[storage] = spent


def _decode_mckp(data: memoryview, *, where: str,
                 admit: Callable[[TensorEntry, str], None]) -> torch.Tensor:
    """The one tensor of an item's MCKP blob; ``admit`` sees its header entry first and raises
    to refuse it, before any of it is allocated."""
    info = read_info(data)  # whole-blob hash, every header size and offset validated
    if len(info.tensors) != 1:
        raise InvalidFormat(f"{where}: expected one tensor in the item, got {len(info.tensors)}")
    entry = info.tensors[0]
    admit(entry, where)
    return decode_tensors(info, lambda r: data[r.offset:r.offset + r.length],
                          verify_payload=False)[entry.name]  # the whole-blob hash covers them


def encode_tensor(t: torch.Tensor, *, name: str = "t", params: CodecParams | None = None,
                  threads: int | None = None) -> bytes:
    """One tensor (chunk) as DCP item bytes: a ``torch.save`` file that holds its MCKP blob
    and decodes it when loaded (see the module docs)."""
    t = t.detach().cpu().contiguous()
    p = params or CodecParams()
    blob = compress_state_dict({name: t}, params=p, threads=threads)
    if t.numel() * t.element_size() > len(blob) * MAX_ITEM_RATIO:  # near-constant, big chunks
        blob = compress_state_dict({name: t}, threads=threads, params=dataclasses.replace(
            p, chunk_bytes=min(p.chunk_bytes, _RATIO_SAFE_CHUNK)))
    buf = io.BytesIO()
    torch.save(_Packed(torch.frombuffer(bytearray(blob), dtype=torch.uint8)), buf)
    return buf.getvalue()


def decode_item(data: bytes | memoryview, *, where: str, dtype: torch.dtype | None = None,
                shape: torch.Size | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`; plain ``torch.save`` items and the bare ``MCKP`` /
    ``MRAW`` items of older versions are read too.

    ``dtype``/``shape``: the item's stored chunk as the DCP metadata records it; a compressed
    item must hold exactly that (checked before decoding). Without them its decoded size is
    bounded by :data:`MAX_ITEM_RATIO` times its blob's; ``MRAW`` items need them."""
    mv = memoryview(data).cast("B")
    magic = bytes(mv[:4])
    expected = None if dtype is None or shape is None else _Expected(dtype, shape, where)
    if magic == MCKP_MAGIC:
        return _decode_mckp(mv, where=where, admit=expected.admit if expected else (
            lambda entry, where: _charge(entry, where, size=len(mv))))
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
    token = _EXPECTED.set(expected)  # what the item's pickle may decode
    try:
        loaded = torch.load(io.BytesIO(bytes(mv)), map_location="cpu", weights_only=True)
    except (InvalidFormat, ChecksumMismatch):
        raise  # our item, damaged: already says what is wrong
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise InvalidFormat(f"{where}: item is neither a mithril blob nor a saved tensor "
                            f"({err})") from err
    finally:
        _EXPECTED.reset(token)
    if not isinstance(loaded, torch.Tensor):
        raise InvalidFormat(f"{where}: item is neither a mithril blob nor a saved tensor")
    return loaded


def _check_flags(cls: str, **flags: object) -> None:
    """The default planners' positional arguments are flags: a number there is almost surely
    a compression level passed positionally (our options are keyword-only), so say so."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{cls}: {name} must be a bool, got {value!r} (positional arguments "
                            f"are those of torch's default planner, in its order; pass our "
                            f"options by keyword, e.g. compression_level=3)")


class MithrilSavePlanner(DefaultSavePlanner):
    """A :class:`DefaultSavePlanner` whose tensor items are written compressed (lossless).

    Positional arguments are :class:`DefaultSavePlanner`'s, in its order; ``compression_level``
    and the other codec options are keyword-only."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None,
                 dedup_save_to_lowest_rank: bool = False, enable_plan_caching: bool = False,
                 *, compression_level: int = 3, byte_grouping: bool = True,
                 chunk_mib: float = 4.0, threads: int | None = None,
                 raw_below: int = RAW_BELOW) -> None:
        _check_flags("MithrilSavePlanner", flatten_state_dict=flatten_state_dict,
                     flatten_sharded_tensors=flatten_sharded_tensors,
                     dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
                     enable_plan_caching=enable_plan_caching)
        if dedup_replicated_tensors is not None:
            _check_flags("MithrilSavePlanner", dedup_replicated_tensors=dedup_replicated_tensors)
        if isinstance(compression_level, bool) or not isinstance(compression_level, int):
            raise TypeError(f"MithrilSavePlanner: compression_level must be an int, got "
                            f"{compression_level!r}")
        if raw_below < 0:
            raise ValueError(f"MithrilSavePlanner: raw_below must be >= 0, got {raw_below}")
        super().__init__(flatten_state_dict, flatten_sharded_tensors, dedup_replicated_tensors,
                         dedup_save_to_lowest_rank, enable_plan_caching)
        self.params = CodecParams(level=compression_level, byte_grouping=byte_grouping,
                                  chunk_bytes=max(1, int(chunk_mib * (1 << 20))))
        self.threads = threads
        self.raw_below = raw_below
        self._compressed: set[MetadataIndex] = set()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, md = super().create_global_plan(all_plans)
        if not isinstance(md, MithrilMetadata):
            md = MithrilMetadata(**{f.name: getattr(md, f.name)
                                    for f in dataclasses.fields(Metadata)})
        self.metadata = md
        return plans, md

    def _small(self, item: WriteItem) -> bool:
        td = item.tensor_data
        if td is None:
            return False
        n = 1
        for s in td.size:
            n *= int(s)
        return n * td.properties.dtype.itemsize < self.raw_below

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        items: list[WriteItem] = []
        for item in plan.items:
            if item.type in (WriteItemType.TENSOR, WriteItemType.SHARD) and not self._small(item):
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
    """A :class:`DefaultLoadPlanner` that reads what :class:`MithrilSavePlanner` wrote (any
    version of it) as well as plain DCP checkpoints. Positional arguments are
    :class:`DefaultLoadPlanner`'s, in its order."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        _check_flags("MithrilLoadPlanner", flatten_state_dict=flatten_state_dict,
                     flatten_sharded_tensors=flatten_sharded_tensors,
                     allow_partial_load=allow_partial_load)
        # keywords: a subclass may put another parameter first (torch's empty-state planner)
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
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
        """The dtype and size of the stored chunk ``index`` names, as the metadata records it.

        A chunk reaching outside its tensor's size is :class:`InvalidFormat`: that size is
        what DCP compares with the live tensor, so it bounds what an item may decode to."""
        md = self.metadata.state_dict_metadata.get(index.fqn) if self.metadata else None
        if not isinstance(md, TensorStorageMetadata):
            return None, None
        for chunk in md.chunks:
            if index.offset is None or tuple(chunk.offsets) == tuple(index.offset):
                dims = len(md.size)
                if (len(chunk.offsets) != dims or len(chunk.sizes) != dims
                        or any(o < 0 or n < 0 or o + n > d for o, n, d
                               in zip(chunk.offsets, chunk.sizes, md.size, strict=True))):
                    raise InvalidFormat(
                        f"{index.fqn}: the checkpoint's metadata places a chunk of size "
                        f"{list(chunk.sizes)} at {list(chunk.offsets)}, outside the tensor's "
                        f"size {list(md.size)}")
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


class _EmptyMithrilLoadPlanner(MithrilLoadPlanner, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (torch's converter planner), reading
    items through :class:`MithrilLoadPlanner`."""


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike[str],
                      torch_save_path: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` for checkpoints of any
    mithril_async version (and plain DCP ones): the whole state dict as one ``torch.save``
    file with ordinary tensors, loadable by ``torch.load`` anywhere. Run it on one process:
    the whole state is held in memory."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(dcp_checkpoint_dir),
                     planner=_EmptyMithrilLoadPlanner(), no_dist=True)
    torch.save(sd, torch_save_path)
