"""JAX and numpy arrays <-> the pieces of a saved item.

Saving (:func:`snapshot_jax`, :func:`snapshot_numpy`) runs on the caller's thread inside
Orbax's ``save()``: each array's addressable replica-0 shards are copied to host memory
before ``save()`` returns, so the caller may donate, delete or overwrite its arrays at once.
JAX on CPU hands out numpy views of the device buffers themselves, so there every shard is
copied; other platforms already return a fresh host buffer.

Restoring (:func:`restore_jax`, :func:`restore_numpy`) reads only the pieces that overlap
the boxes this process needs (its addressable devices' boxes of the target sharding, or the
whole array for numpy), in batches of bounded size, and builds each array with
``jax.make_array_from_callback``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import layout as jax_layout
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.serialization import types as ocp_types
from orbax.checkpoint._src.serialization.jax_array_restore_args import ArrayRestoreArgs

from mithril_async.codec.dtypes import DTYPES, dtype_name
from mithril_async.integrations.orbax.blobs import SavedItem
from mithril_async.integrations.orbax.layout import (
    Box,
    ParamRecord,
    Piece,
    box_from_index,
    box_shape,
    intersect,
    piece_tensor_name,
    volume,
)

__all__ = ["HostParam", "pack", "restore_jax", "restore_numpy", "snapshot_jax",
           "snapshot_numpy"]

#: decoded bytes one restore batch may hold before its arrays are built
BATCH_BYTES = 256 << 20


@dataclasses.dataclass
class HostParam:
    """One param's host copies: what this process's blob will hold of it (``record``
    without pieces: they are named when the blob is packed)."""

    record: ParamRecord
    pieces: list[tuple[Box, np.ndarray[Any, Any]]]


def _serialized_sharding(sharding: jax.sharding.Sharding) -> str | None:
    meta = sharding_metadata.from_jax_sharding(sharding)
    return None if meta is None else meta.to_serialized_string()


def _start_copy(data: jax.Array, device: jax.Device, pinned: bool) -> jax.Array:
    """Start ``data``'s copy to the host: into pinned host memory when asked and the device
    has some (as Orbax's ``enable_pinned_host_transfer``), else the device's own copy."""
    if pinned and any(m.kind == "pinned_host" for m in device.addressable_memories()):
        return jax.device_put(data, jax.sharding.SingleDeviceSharding(
            device, memory_kind="pinned_host"))
    data.copy_to_host_async()
    return data


def snapshot_jax(value: jax.Array, name: str, arg: ocp_types.SaveArgs, *,
                 pinned: bool = False) -> HostParam:
    """Host copies of ``value``'s addressable replica-0 shards (cast to ``arg.dtype``)."""
    key_impl = None
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        key_impl = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    if arg.dtype is not None and np.dtype(arg.dtype) != value.dtype:
        value = value.astype(arg.dtype)
    shards = [s for s in value.addressable_shards if s.replica_id == 0]
    copies = [_start_copy(s.data, s.device, pinned) for s in shards]
    shape = tuple(value.shape)
    pieces = []
    for s, data in zip(shards, copies, strict=True):
        host = np.asarray(data)
        if s.device.platform == "cpu":  # a view of the device buffer itself
            host = host.copy()
        pieces.append((box_from_index(s.index, shape), host))
    return HostParam(ParamRecord(name, "jax", shape, dtype_name(np.dtype(value.dtype), where=name),
                                 _serialized_sharding(value.sharding), key_impl), pieces)


def snapshot_numpy(value: np.ndarray[Any, Any], name: str, arg: ocp_types.SaveArgs,
                   *, keep: bool) -> HostParam:
    """A copy of ``value`` (cast to ``arg.dtype``); ``keep=False`` (a process other than the
    primary one) records the param but no piece."""
    if arg.dtype is not None:
        value = value.astype(arg.dtype)
    shape = tuple(value.shape)
    pieces = [(tuple((0, n) for n in shape), np.array(value, copy=True))] if keep else []
    return HostParam(ParamRecord(name, "numpy", shape, dtype_name(value, where=name), None, None),
                     pieces)


def pack(params: Sequence[HostParam]) -> tuple[dict[str, np.ndarray[Any, Any]],
                                               list[dict[str, Any]]]:
    """The blob tensors and index entries of ``params`` (params without pieces left out)."""
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    entries = []
    for p in params:
        if not p.pieces:
            continue
        rec = dataclasses.replace(p.record, pieces=[])
        for box, host in p.pieces:
            tensor = piece_tensor_name(rec.name, box)
            tensors[tensor] = host
            rec.pieces.append(Piece("", tensor, box))
        entries.append(rec.index_entry())
    return tensors, entries


def _target_sharding(arg: ocp_types.RestoreArgs, rec: ParamRecord) -> jax.sharding.Sharding:
    """The sharding to restore into: the args' (``mesh`` + ``mesh_axes``, or ``sharding``),
    else the saved one (Orbax's own error when this topology lacks its devices)."""
    if isinstance(arg, ArrayRestoreArgs):
        if arg.mesh is not None and arg.mesh_axes is not None:
            return jax.sharding.NamedSharding(arg.mesh, arg.mesh_axes)
        s = arg.sharding
        if isinstance(s, sharding_metadata.ShardingMetadata):
            return s.to_jax_sharding()
        if isinstance(s, jax_layout.Format):
            s = s.sharding
        if s is not None:
            return s
    if rec.sharding is None:
        raise ValueError('Sharding of jax.Array cannot be None. Provide `mesh`'
                         ' and `mesh_axes` OR `sharding`')
    return sharding_metadata.from_serialized_string(rec.sharding).to_jax_sharding()


def _key_sharding(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding:
    """A PRNG key's sharding widened to its key data (trailing axes unsharded)."""
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) < ndim:
        spec = jax.sharding.PartitionSpec(*sharding.spec,
                                          *([None] * (ndim - len(sharding.spec))))
        return jax.sharding.NamedSharding(sharding.mesh, spec)
    return sharding


def _check_shape(rec: ParamRecord, shape: tuple[int, ...], strict: bool) -> None:
    if strict and shape != rec.shape:
        raise ValueError(
            f'Requested shape: {shape} is not compatible with the stored'
            f' shape: {rec.shape}. Truncating/padding is disabled. To enable it,'
            ' set `strict=False` in `ArrayRestoreArgs` for any array in v0 API'
            ' or `enable_padding_and_truncation=True` in `ArrayOptions.Loading`'
            ' in v1 API.')
    if len(shape) != len(rec.shape):
        raise ValueError(f"param {rec.name!r}: cannot restore a {len(rec.shape)}-d array "
                         f"as shape {shape}")


@dataclasses.dataclass
class _Plan:
    """One param's restore: the boxes this process builds and the pieces they read."""

    rec: ParamRecord
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sharding: jax.sharding.Sharding | None  # None: a numpy result
    boxes: list[Box]
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        itemsize = DTYPES[self.rec.dtype].itemsize
        return sum(volume(box_shape(p.box)) for p in self.pieces) * itemsize


def _plan(rec: ParamRecord, shape: tuple[int, ...], dtype: Any,
          sharding: jax.sharding.Sharding | None) -> _Plan:
    if sharding is None:
        boxes = [tuple((0, n) for n in shape)]
    else:
        seen = {box_from_index(i, shape): None
                for i in sharding.addressable_devices_indices_map(shape).values()
                if i is not None}
        boxes = list(seen)
    saved = tuple((0, n) for n in rec.shape)
    wanted = [b for b in (intersect(box, saved) for box in boxes) if b is not None]
    pieces = [p for p in rec.pieces if any(intersect(p.box, b) is not None for b in wanted)]
    return _Plan(rec, shape, np.dtype(dtype), sharding, boxes, pieces)


def _assemble(plan: _Plan, box: Box, decoded: dict[Piece, np.ndarray[Any, Any]],
              ) -> np.ndarray[Any, Any]:
    """The target ``box`` of ``plan``'s array from its decoded pieces (zeros outside the
    saved shape: padding), cast to the target dtype."""
    for p in plan.pieces:
        if p.box == box:  # the same sharding as saved: the piece itself
            return _cast(decoded[p], plan.dtype)
    saved_dtype = DTYPES[plan.rec.dtype].numpy_dtype
    inside = intersect(box, tuple((0, n) for n in plan.rec.shape))
    padded = inside is None or box_shape(inside) != box_shape(box)
    out = (np.zeros if padded else np.empty)(box_shape(box), saved_dtype)
    for p in plan.pieces:
        common = intersect(box, p.box)
        if common is not None:
            dst = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(common, box,
                                                                            strict=True))
            src = tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(common, p.box,
                                                                            strict=True))
            out[dst] = decoded[p][src]
    return _cast(out, plan.dtype)


def _cast(a: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    return a if a.dtype == dtype else a.astype(dtype)


def _batches(plans: list[_Plan]) -> Iterator[list[_Plan]]:
    """``plans`` in runs of at most :data:`BATCH_BYTES` of pieces (a bigger plan alone)."""
    batch: list[_Plan] = []
    size = 0
    for p in plans:
        if batch and size + p.nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p.nbytes
    if batch:
        yield batch


def _build(item: SavedItem, plans: list[_Plan], threads: int | None) -> list[Any]:
    out: list[Any] = []
    for batch in _batches(plans):
        decoded = item.read(((p.rec.name, piece) for p in batch for piece in p.pieces),
                            threads=threads)
        for plan in batch:
            if plan.sharding is None:
                out.append(_assemble(plan, plan.boxes[0], decoded))
                continue
            parts = {box: _assemble(plan, box, decoded) for box in plan.boxes}
            shape = plan.shape

            def data(index: Any, parts: dict[Box, Any] = parts,
                     shape: tuple[int, ...] = shape) -> Any:
                return parts[box_from_index(index, shape)]

            arr = jax.make_array_from_callback(shape, plan.sharding, data)
            if plan.rec.key_impl is not None:
                arr = jax.random.wrap_key_data(arr, impl=plan.rec.key_impl)
            out.append(arr)
        del decoded
    return out


def restore_jax(item: SavedItem, requests: Sequence[tuple[ParamRecord, ocp_types.RestoreArgs]],
                threads: int | None) -> list[jax.Array]:
    """``jax.Array`` s of the requested params, as their restore args ask."""
    plans = []
    for rec, arg in requests:
        sharding = _target_sharding(arg, rec)
        if rec.key_impl is not None:  # stored as key data: restored at its own shape
            shape, dtype = rec.shape, DTYPES[rec.dtype].numpy_dtype
            sharding = _key_sharding(sharding, len(shape))
        else:
            shape = rec.shape
            if isinstance(arg, ArrayRestoreArgs) and arg.global_shape is not None:
                shape = tuple(arg.global_shape)
            _check_shape(rec, shape, getattr(arg, "strict", True))
            dtype = arg.dtype if arg.dtype is not None else DTYPES[rec.dtype].numpy_dtype
        plans.append(_plan(rec, shape, dtype, sharding))
    return _build(item, plans, threads)


def restore_numpy(item: SavedItem,
                  requests: Sequence[tuple[ParamRecord, ocp_types.RestoreArgs]],
                  threads: int | None) -> list[np.ndarray[Any, Any]]:
    """Whole numpy arrays of the requested params (cast to ``arg.dtype`` if given)."""
    plans = [_plan(rec, rec.shape,
                   arg.dtype if arg.dtype is not None else DTYPES[rec.dtype].numpy_dtype, None)
             for rec, arg in requests]
    return _build(item, plans, threads)
