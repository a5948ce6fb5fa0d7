"""Encode a staged state item into one blob streamed to a Store, and decode it back.

Compression on: an MCKP blob (docs/FORMAT.md). The tensors are cut into chunks; chunks are
encoded on the codec thread pool (native transforms + zstd, GIL released) while finished chunks
are appended to the store's streaming writer in completion order, so transform, entropy coding
and I/O overlap. Encoded bytes in flight are bounded by ``max_inflight_mib`` (back-pressure is
the memory bound). Compression off: a plain ``.safetensors`` file streamed straight from the
staging buffers. Either way the state tree's non-tensor skeleton travels in the blob's metadata,
and the blob's xxhash64 goes into the manifest.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.torch
import torch
import xxhash

from mithril_async.codec.chunk import CodecParams, EncodedChunk, encode_chunk
from mithril_async.codec.container import MckpWriter, TensorEntry
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.safetensors_io import safetensors_header
from mithril_async.codec.state_dict import decompress_state_dict, read_info
from mithril_async.config import CompressionConfig, PipelineConfig
from mithril_async.errors import ChecksumMismatch, InvalidFormat
from mithril_async.manifest import BlobRef
from mithril_async.storage.base import BlobWriter, Store

SKELETON_KEY = "mithril.skeleton"
ITEM_KEY = "mithril.item"


@dataclass
class StagedItem:
    """One stateful object's snapshot: its tree skeleton and its staged tensors."""

    name: str
    skeleton: Any
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _Budget:
    """A byte budget for data in flight between encoder threads and the store."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit


class BlobCodec:
    """Turns staged items into blobs and back, as the config says."""

    def __init__(self, comp: CompressionConfig, pipe: PipelineConfig, pool: Executor) -> None:
        self.comp = comp
        self.pipe = pipe
        self.pool = pool
        self.params = CodecParams(level=comp.level, byte_grouping=comp.byte_grouping,
                                  chunk_bytes=max(1, int(comp.chunk_mib * (1 << 20))))

    @property
    def model_ext(self) -> str:
        return "mckp" if self.comp.enabled else "safetensors"

    def describe(self) -> dict[str, Any]:
        """What the manifest records about how blobs were made."""
        if not self.comp.enabled:
            return {"format": "safetensors"}
        return {"format": "mckp", **self.params.to_dict()}

    # ------------------------------------------------------------------ write
    async def write(self, store: Store, key: str, item: StagedItem, *, step: int) -> BlobRef:
        writer = store.open_writer(key)
        try:
            if self.comp.enabled:
                digest = await self._write_mckp(writer, item, step)
                fmt = "mckp"
            else:
                digest = await self._write_safetensors(writer, item)
                fmt = "safetensors"
            size = await writer.commit()
        except BaseException:
            await asyncio.shield(writer.abort())
            raise
        return BlobRef(key=key, bytes=size, xxh64=digest, format=fmt,
                       raw_bytes=item.nbytes)

    def _metadata(self, item: StagedItem) -> dict[str, str]:
        return {SKELETON_KEY: json.dumps(item.skeleton, separators=(",", ":")),
                ITEM_KEY: item.name}

    async def _write_safetensors(self, writer: BlobWriter, item: StagedItem) -> str:
        h = xxhash.xxh64()
        header = safetensors_header(item.tensors, self._metadata(item))
        h.update(header)
        await writer.write(header)
        loop = asyncio.get_running_loop()
        step = self.params.chunk_bytes
        for t in item.tensors.values():
            view, _, _ = tensor_bytes(t)
            for off in range(0, view.size, step):
                piece = memoryview(view[off:off + step].data)
                await loop.run_in_executor(self.pool, h.update, piece)
                await writer.write(piece)
        return h.hexdigest()

    async def _write_mckp(self, writer: BlobWriter, item: StagedItem, step: int) -> str:
        views: list[np.ndarray[Any, Any]] = []
        entries: list[TensorEntry] = []
        jobs: list[tuple[int, int, int, int]] = []
        for ti, (name, t) in enumerate(item.tensors.items()):
            view, dtype_name, shape = tensor_bytes(t, where=name)
            entry = TensorEntry.make(name, dtype_name, shape, self.params.chunk_bytes)
            views.append(view)
            entries.append(entry)
            jobs.extend((ti, ci, off, n) for ci, (off, n) in enumerate(entry.chunks))
        mckp = MckpWriter(entries, params=self.params, training_step=step,
                          metadata=self._metadata(item))
        await writer.write(mckp.begin())
        await self._run_chunks(jobs, views, entries, lambda ti, ci, enc: writer.write(
            mckp.add(ti, ci, enc)))
        await writer.write(mckp.finish())
        return f"{mckp.xxh64:016x}"

    async def _run_chunks(
        self,
        jobs: list[tuple[int, int, int, int]],
        views: list[np.ndarray[Any, Any]],
        entries: list[TensorEntry],
        sink: Callable[[int, int, EncodedChunk], Awaitable[None]],
    ) -> None:
        """Encode chunks on the pool, at most ``max_inflight_mib`` of them in flight."""
        loop = asyncio.get_running_loop()
        budget = _Budget(self.pipe.max_inflight_mib << 20)
        pending: set[asyncio.Future[tuple[int, int, int, EncodedChunk]]] = set()

        def encode(ti: int, ci: int, off: int, n: int) -> tuple[int, int, int, EncodedChunk]:
            src = views[ti][off:off + n]
            return ti, ci, n, encode_chunk(src, entries[ti].dtype, None, self.params)

        async def drain_one() -> None:
            nonlocal pending
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                ti, ci, n, enc = fut.result()
                await sink(ti, ci, enc)
                budget.used -= n

        try:
            for ti, ci, off, n in jobs:
                while not budget.fits(n):
                    await drain_one()
                budget.used += n
                pending.add(loop.run_in_executor(self.pool, encode, ti, ci, off, n))
            while pending:
                await drain_one()
        finally:
            for fut in pending:
                fut.cancel()

    # ------------------------------------------------------------------ read
    async def read(self, store: Store, ref: BlobRef) -> tuple[Any, dict[str, torch.Tensor]]:
        """Fetch, verify and decode one blob; return (skeleton, tensors)."""
        data = await store.get(ref.key)
        loop = asyncio.get_running_loop()
        if len(data) != ref.bytes:
            raise InvalidFormat(f"{ref.key}: {len(data)} bytes, manifest says {ref.bytes}")
        digest = await loop.run_in_executor(self.pool, xxhash.xxh64_hexdigest, data)
        if digest != ref.xxh64:
            raise ChecksumMismatch(ref.key, ref.xxh64, digest)
        if ref.format == "safetensors":
            return await loop.run_in_executor(self.pool, _decode_safetensors, data, ref.key)
        return await loop.run_in_executor(None, self._decode_mckp, data, ref.key)

    def _decode_mckp(self, data: bytes, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """Decode a verified MCKP blob with the codec's threads (chunks in parallel)."""
        metadata = read_info(data, verify=False).metadata
        threads = getattr(self.pool, "_max_workers", None)
        tensors = decompress_state_dict(data, threads=threads, verify=False)
        return _skeleton(metadata, where), tensors


def _skeleton(metadata: dict[str, Any], where: str) -> Any:
    raw = metadata.get(SKELETON_KEY)
    if not isinstance(raw, str):
        raise InvalidFormat(f"{where}: blob has no state skeleton")
    try:
        return json.loads(raw)
    except ValueError as err:
        raise InvalidFormat(f"{where}: state skeleton is not JSON ({err})") from None


def _decode_safetensors(data: bytes, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    try:
        tensors = safetensors.torch.load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    except Exception as err:
        raise InvalidFormat(f"{where}: not a valid safetensors blob ({err})") from None
    return _skeleton(metadata, where), tensors
