"""Orbax ``TypeHandler`` s that store ``jax.Array`` and ``np.ndarray`` leaves with our codec.

A pytree handler groups a save's leaves by type handler and calls each handler's
``serialize`` once, so one save of one item makes one blob per process per handler.
``serialize`` copies the arrays to host memory and returns; the commit future Orbax runs in
its background thread waits for the item folder, then encodes and writes the blob.
``deserialize`` reads only the requested params; a param the folder's blobs do not hold
(an item saved by Orbax's own handlers) goes to Orbax's stock handler, so checkpoints written
before switching still load.

The handlers' type strings (recorded per leaf in Orbax's ``_METADATA``) are their own, so a
reader without these handlers registered is told the type is unknown instead of opening
files that are not there.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
import numpy as np
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.metadata import value as value_metadata
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import types as ocp_types
from orbax.checkpoint._src.serialization.jax_array_handlers import (
    ArrayHandler,
    check_array_values,
)
from orbax.checkpoint._src.serialization.type_handlers import NumpyHandler

from mithril_async.codec.dtypes import DTYPES
from mithril_async.errors import ConfigError
from mithril_async.integrations.orbax import arrays
from mithril_async.integrations.orbax.blobs import SavedItem, local_folder, write_blob
from mithril_async.integrations.orbax.layout import ParamRecord, box_shape

__all__ = ["ARRAY_TYPESTR", "NUMPY_TYPESTR", "MithrilArrayHandler", "MithrilNumpyHandler"]

ARRAY_TYPESTR = "mithril_async.jax.Array"
NUMPY_TYPESTR = "mithril_async.np.ndarray"


def check_level(compression_level: object) -> int:
    if type(compression_level) is not int or not 1 <= compression_level <= 22:
        raise ConfigError(f"compression_level must be an integer from 1 to 22 (zstd levels), "
                          f"got {compression_level!r}")
    return compression_level


class _MithrilHandler(ocp_types.TypeHandler):
    """What the array and numpy handlers share: the commit, the split between our params and
    the stock handler's, the metadata."""

    kind: str
    #: BasePyTreeCheckpointHandler looks for Orbax's per-array metadata store on the
    #: jax.Array handler; our index holds that information, so there is none
    _array_metadata_store = None

    def __init__(self, compression_level: int, threads: int | None,
                 fallback: ocp_types.TypeHandler) -> None:
        self._level = check_level(compression_level)
        if threads is not None and (type(threads) is not int or threads < 1):
            raise ConfigError(f"threads must be a positive integer or None, got {threads!r}")
        self._threads = threads
        self._fallback = fallback

    def _commit(self, params: list[arrays.HostParam], infos: Sequence[ocp_types.ParamInfo],
                ) -> future.Future:
        level, threads, process = self._level, self._threads, multihost.process_index()

        async def commit() -> None:
            await asyncio.gather(*(i.await_path_creation() for i in infos))
            tensors, entries = arrays.pack(params)
            if tensors:
                folder = local_folder(infos[0].parent_dir)
                await asyncio.to_thread(write_blob, folder, process, tensors, entries,
                                        level=level, threads=threads)

        return future.CommitFutureAwaitingContractedSignals(
            commit(), name=f"mithril_{self.kind}_handler")

    async def _split(self, infos: Sequence[ocp_types.ParamInfo], args: Sequence[Any],
                     ours: Callable[[SavedItem, list[_Request]], list[Any]],
                     theirs: Callable[[list[ocp_types.ParamInfo], list[Any]], Awaitable[Any]],
                     ) -> list[Any]:
        """``ours`` (on a worker thread) for the params the folder's blobs hold, ``theirs``
        for the rest; results in ``infos`` order."""
        await asyncio.gather(*(i.await_path_creation() for i in infos))
        item = await asyncio.to_thread(SavedItem.open, local_folder(infos[0].parent_dir))
        try:
            records = item.records if item is not None else {}
            mine = [i for i, info in enumerate(infos) if info.name in records]
            other = [i for i, info in enumerate(infos) if info.name not in records]
            results: list[Any] = [None] * len(infos)
            if other:
                got = await theirs([infos[i] for i in other], [args[i] for i in other])
                for i, v in zip(other, got, strict=True):
                    results[i] = v
            if mine:
                assert item is not None
                reqs = [_Request(records[infos[i].name], args[i], infos[i]) for i in mine]
                got = await asyncio.to_thread(ours, item, reqs)
                for i, v in zip(mine, got, strict=True):
                    results[i] = v
            return results
        finally:
            if item is not None:
                item.close()

    async def metadata(self, infos: Sequence[ocp_types.ParamInfo],
                       ) -> Sequence[value_metadata.Metadata]:
        """``ArrayMetadata`` per param: shape, dtype, saved sharding (jax arrays), and the
        shape of one saved piece as storage chunk shape (and write shape, for jax arrays,
        as Orbax records it only for those)."""
        def ours(_: SavedItem, reqs: list[_Request]) -> list[Any]:
            return [self._meta(r.record, r.info) for r in reqs]

        async def theirs(subset: list[ocp_types.ParamInfo], _: list[Any]) -> Any:
            return await self._fallback.metadata(subset)

        return await self._split(infos, [None] * len(infos), ours, theirs)

    def _meta(self, rec: ParamRecord, info: ocp_types.ParamInfo) -> value_metadata.ArrayMetadata:
        piece = box_shape(rec.pieces[0].box) if rec.pieces else rec.shape
        sharding = None
        if self.kind == "jax" and rec.sharding is not None:
            sharding = sharding_metadata.from_serialized_string(rec.sharding)
        return value_metadata.ArrayMetadata(
            name=info.name, directory=info.parent_dir, shape=rec.shape, sharding=sharding,
            dtype=jax.numpy.dtype(DTYPES[rec.dtype].numpy_dtype),
            storage=value_metadata.StorageMetadata(
                chunk_shape=piece, write_shape=piece if self.kind == "jax" else None))


@dataclasses.dataclass(frozen=True)
class _Request:
    """One param of ours to read: its record, its restore args, its Orbax param info."""

    record: ParamRecord
    arg: Any
    info: ocp_types.ParamInfo


class MithrilArrayHandler(_MithrilHandler):
    """``jax.Array`` leaves: each process writes its addressable replica-0 shards into one
    blob per save; restores build any target sharding (``ArrayRestoreArgs``: ``sharding``, or
    ``mesh`` + ``mesh_axes``; ``global_shape`` with ``strict``; ``dtype``), or the saved one
    when the args give none. Params not written by this handler go to Orbax's
    ``ArrayHandler``."""

    kind = "jax"

    def __init__(self, compression_level: int = 3, *, threads: int | None = None,
                 fallback: ArrayHandler | None = None) -> None:
        super().__init__(compression_level, threads, fallback or ArrayHandler(
            array_metadata_store=array_metadata_store_lib.Store()))

    def typestr(self) -> str:
        return ARRAY_TYPESTR

    async def serialize(self, values: Sequence[jax.Array], infos: Sequence[ocp_types.ParamInfo],
                        args: Sequence[ocp_types.SaveArgs] | None = None,
                        ) -> Sequence[future.Future]:
        args = args or [ocp_types.SaveArgs()] * len(values)
        ocp_types.check_input_arguments(values, infos, args)
        check_array_values(values, infos)
        for v, info in zip(values, infos, strict=True):
            if jax.process_count() > 1 and v.is_fully_addressable:
                raise ValueError(f"Cannot serialize host local jax.Array {info.name!r} in a "
                                 "multi-host setting (make it a global array first)")
        params = [arrays.snapshot_jax(v, info.name, a, pinned=info.enable_pinned_host_transfer)
                  for v, info, a in zip(values, infos, args, strict=True)]
        return [self._commit(params, infos)]

    async def deserialize(self, infos: Sequence[ocp_types.ParamInfo],
                          args: Sequence[ocp_types.RestoreArgs] | None = None,
                          ) -> Sequence[jax.Array]:
        if args is None:
            raise ValueError("Must provide ArrayRestoreArgs to restore as jax.Array.")
        ocp_types.check_input_arguments(infos, args)
        threads = self._threads

        def ours(item: SavedItem, reqs: list[_Request]) -> list[Any]:
            return arrays.restore_jax(item, [(r.record, r.arg) for r in reqs], threads)

        return await self._split(infos, args, ours, self._fallback.deserialize)


class MithrilNumpyHandler(_MithrilHandler):
    """``np.ndarray`` leaves (written whole by the primary process), and any param of ours
    restored as ``np.ndarray`` (a jax.Array too: its pieces from every process's blob).
    Params not written by us go to Orbax's ``NumpyHandler``."""

    kind = "numpy"

    def __init__(self, compression_level: int = 3, *, threads: int | None = None,
                 fallback: NumpyHandler | None = None) -> None:
        super().__init__(compression_level, threads, fallback or NumpyHandler())

    def typestr(self) -> str:
        return NUMPY_TYPESTR

    async def serialize(self, values: Sequence[np.ndarray[Any, Any]],
                        infos: Sequence[ocp_types.ParamInfo],
                        args: Sequence[ocp_types.SaveArgs] | None = None,
                        ) -> Sequence[future.Future]:
        args = args or [ocp_types.SaveArgs()] * len(values)
        ocp_types.check_input_arguments(values, infos, args)
        check_array_values(values, infos)
        keep = multihost.process_index() == 0
        params = [arrays.snapshot_numpy(v, info.name, a, keep=keep)
                  for v, info, a in zip(values, infos, args, strict=True)]
        return [self._commit(params, infos)]

    async def deserialize(self, infos: Sequence[ocp_types.ParamInfo],
                          args: Sequence[ocp_types.RestoreArgs] | None = None,
                          ) -> Sequence[np.ndarray[Any, Any]]:
        args = args or [ocp_types.RestoreArgs()] * len(infos)
        ocp_types.check_input_arguments(infos, args)
        threads = self._threads

        def ours(item: SavedItem, reqs: list[_Request]) -> list[Any]:
            return arrays.restore_numpy(item, [(r.record, r.arg) for r in reqs], threads)

        return await self._split(infos, args, ours, self._fallback.deserialize)
