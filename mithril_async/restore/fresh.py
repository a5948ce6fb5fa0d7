"""Decoding blobs into fresh tensors, delta bases and referenced tensors resolved.

What a restore cannot write straight into the live state (a delta, a blob referencing
tensors of other versions, a tool's read with no live state, a blob over S3 that would need
two reads) is decoded here into new tensors: :class:`FreshDecoder`. Each blob is verified
before a byte of it is decoded: the whole blob by its manifest hash, or, for a part of a
delta base asked for a few tensors, every block by its own hashes
(:func:`~mithril_async.restore.sources.read_partial`). What the blob claims to decode to is
checked against the manifest's ``raw_bytes`` before anything is allocated (a few hundred
bytes of MCKP can declare a GiB of zeros), and what it decoded to after.

:class:`BaseLoader` resolves delta bases and referenced tensors for one restore: every link
is checked (the holder version's manifest must list the blob with the xxh64 the reference
names), a blob is asked only for the tensors needed from it, and decoded tensors are cached
per blob.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import xxhash

from mithril_async.codec.container import BlockRef, MckpInfo
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.formats import blob_format
from mithril_async.codec.state_dict import decode_tensors, read_info
from mithril_async.errors import ChecksumMismatch, InvalidFormat, KeyNotFound, MissingPrevious
from mithril_async.manifest import BaseRef, BlobRef, version_number
from mithril_async.pipeline.blobs import REFS_KEY, TensorRef, skeleton_of
from mithril_async.restore.sources import check_size, read_partial
from mithril_async.restore.windows import pool_threads
from mithril_async.storage.base import Store

if TYPE_CHECKING:
    from mithril_async.catalog import RunCatalog

__all__ = ["BaseLoader", "FreshDecoder", "LoadBlob"]

#: ``load_blob(base, names)``: the tensors ``names`` of the blob ``base`` names, decoded and
#: verified (at least those; the loader may cache and return more)
LoadBlob = Callable[[BaseRef, frozenset[str]], Awaitable[dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class _FetchedBlob:
    """An MCKP blob fetched and checked, ready to decode (see :meth:`FreshDecoder._open`)."""

    info: MckpInfo
    block_bytes: Callable[[BlockRef], memoryview]
    #: whether each block's payload hash is still to be checked (no whole-blob hash was)
    verify_blocks: bool
    #: tensors the blob only references, by name
    refs: dict[str, TensorRef]


class FreshDecoder:
    """Fetch, verify and decode lossless blobs into new tensors on ``pool``.

    ``progress(n)``: called with the raw bytes of each chunk (or whole safetensors blob, or
    referenced tensor) decoded for a whole blob asked for (:meth:`read` without ``only``,
    :meth:`read_each`), on any thread; they add up to the blob's ``raw_bytes``. Parts of
    blobs read along the way (delta bases, referenced tensors' holders) are not counted.
    """

    def __init__(self, pool: Executor, progress: Callable[[int], None] | None = None) -> None:
        self.pool = pool
        self.progress = progress

    async def read(self, store: Store, ref: BlobRef, load_blob: LoadBlob | None = None,
                   only: frozenset[str] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
        """(skeleton, tensors) of one blob, every checksum on the way verified. ``only``:
        decode just these tensors; when their blocks are a small part of the blob only they
        are read (ranged reads), else the whole blob is read and hashed. Delta bases and
        referenced tensors come through ``load_blob``, each base asked only for what this
        blob's deltas need."""
        opened = await self._open(store, ref, only)
        counted = self.progress if only is None else None
        if not isinstance(opened, _FetchedBlob):
            if counted is not None:
                counted(_nbytes(opened[1].values()))
            return opened  # safetensors: (skeleton, tensors), decoded whole
        tensors = await self._decode(ref, opened, load_blob, only, counted)
        if only is None:
            _check_raw_bytes(ref, _nbytes(tensors.values()))
        return skeleton_of(opened.info.metadata, ref.key), tensors

    async def read_each(self, store: Store, ref: BlobRef, new_loader: Callable[[], LoadBlob],
                        ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every tensor of blob ``ref``, verified as :meth:`read` verifies, one at a time:
        each decoded alone with a fresh loader from ``new_loader()`` and droppable before the
        next, so checking a blob (``mithril verify``) holds its bytes plus one tensor (and
        that tensor along its delta chain)."""
        opened = await self._open(store, ref, None)
        if not isinstance(opened, _FetchedBlob):
            _check_raw_bytes(ref, _nbytes(opened[1].values()))
            if self.progress is not None:
                self.progress(ref.raw_bytes)
            for item in opened[1].items():
                yield item
            return
        skeleton_of(opened.info.metadata, ref.key)  # a blob that restores must have one
        total = 0
        for name in [*(t.name for t in opened.info.tensors), *opened.refs]:
            tensor = (await self._decode(ref, opened, new_loader(), frozenset((name,)),
                                         self.progress))[name]
            total += _nbytes((tensor,))
            yield name, tensor
        _check_raw_bytes(ref, total)

    async def _open(self, store: Store, ref: BlobRef, only: frozenset[str] | None
                    ) -> _FetchedBlob | tuple[Any, dict[str, torch.Tensor]]:
        """Fetch and check what :meth:`read` needs before decoding: the blob's size and hash
        (or, for a part of it, each piece's), its header, index and tensor references, and
        that its header claims no more raw bytes than the manifest records. A safetensors
        blob is decoded here, whole: (skeleton, tensors)."""
        fmt = blob_format(ref.format, ref.key)
        if not fmt.lossless:  # lossy (MLDC) blobs decode only along their chain
            raise InvalidFormat(f"{ref.key}: a {ref.format!r} blob, not one decoded on its "
                                "own")
        size = await check_size(store, ref)
        loop = asyncio.get_running_loop()
        part = (await read_partial(store, ref.key, size, only)
                if only is not None and fmt.ranged_parts else None)
        if part is not None:  # some tensors of a base: ranged reads, every piece hashed
            info, block_bytes = part
            verify_blocks = True
        else:
            data = await store.get(ref.key)
            if len(data) != ref.bytes:
                raise InvalidFormat(f"{ref.key}: {len(data)} bytes, manifest says {ref.bytes}")
            digest = await loop.run_in_executor(self.pool, xxhash.xxh64_hexdigest, data)
            if digest != ref.xxh64:
                raise ChecksumMismatch(ref.key, ref.xxh64, digest)
            if not fmt.block_hashes:  # safetensors
                return await loop.run_in_executor(self.pool, _decode_safetensors, data, ref.key)
            info = await loop.run_in_executor(self.pool, lambda: read_info(data, verify=False))
            whole = memoryview(data).cast("B")

            def block_bytes(r: BlockRef) -> memoryview:
                return whole[r.offset:r.offset + r.length]

            verify_blocks = False  # the whole-blob hash above covers every block
        if info.original_size > ref.raw_bytes:  # before a byte of it is decoded
            raise InvalidFormat(f"{ref.key}: its header declares {info.original_size} raw "
                                f"bytes, the manifest records {ref.raw_bytes}")
        refs = info.metadata.get(REFS_KEY, {})
        if not isinstance(refs, dict):
            raise InvalidFormat(f"{ref.key}: malformed tensor references")
        trefs = {name: TensorRef.from_json(raw, ref.key) for name, raw in refs.items()}
        return _FetchedBlob(info, block_bytes, verify_blocks, trefs)

    async def _load_links(self, ref: BlobRef, info: MckpInfo, trefs: dict[str, TensorRef],
                          load_blob: LoadBlob | None, only: frozenset[str] | None
                          ) -> tuple[set[str], dict[str, dict[str, torch.Tensor]]]:
        """The delta tensors to decode and, by blob key, what was loaded from each other
        blob (delta base and referenced tensors), each blob asked once for all of it."""
        need: dict[str, tuple[BaseRef, set[str]]] = {}
        deltas = {t.name for t in info.tensors if t.base_xxh64 is not None
                  and (only is None or t.name in only)}
        if deltas:
            if ref.base is None or load_blob is None:
                raise MissingPrevious(f"{ref.key} is a delta but names no base it can be "
                                      "decoded against")
            need[ref.base.key] = (ref.base, set(deltas))
        for name, tref in trefs.items():
            if load_blob is None:
                raise MissingPrevious(f"{ref.key}: tensor {name!r} lives in {tref.holder.key}")
            holder_ref, names = need.setdefault(tref.holder.key, (tref.holder, set()))
            if holder_ref.xxh64 != tref.holder.xxh64:
                raise MissingPrevious(f"{ref.key}: tensor {name!r} names {tref.holder.key} with "
                                      f"xxh64 {tref.holder.xxh64}, another link says "
                                      f"{holder_ref.xxh64}")
            names.add(tref.name)
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for key, (base_ref, names) in need.items():
            assert load_blob is not None
            loaded[key] = await load_blob(base_ref, frozenset(names))
        return deltas, loaded

    async def _decode(self, ref: BlobRef, opened: _FetchedBlob, load_blob: LoadBlob | None,
                      only: frozenset[str] | None,
                      progress: Callable[[int], None] | None = None
                      ) -> dict[str, torch.Tensor]:
        """The tensors (``only`` these) of an opened blob, delta bases and referenced
        tensors fetched through ``load_blob`` and checked; ``progress`` counts their bytes."""
        info = opened.info
        loop = asyncio.get_running_loop()
        trefs = {name: r for name, r in opened.refs.items() if only is None or name in only}
        deltas, loaded = await self._load_links(ref, info, trefs, load_blob, only)
        previous = loaded[ref.base.key] if deltas and ref.base is not None else None
        threads = pool_threads(self.pool)
        try:
            tensors = await loop.run_in_executor(None, lambda: decode_tensors(
                info, opened.block_bytes, previous=previous, threads=threads, only=only,
                verify_payload=opened.verify_blocks, progress=progress))
        except ChecksumMismatch as err:  # name the blob: a block's own message cannot
            raise ChecksumMismatch(f"{ref.key}: {err.where}", err.expected,
                                   err.actual) from None
        except InvalidFormat as err:
            raise type(err)(f"{ref.key}: {err}") from None
        for name, tref in trefs.items():
            holder = loaded[tref.holder.key]
            if tref.name not in holder:
                raise MissingPrevious(f"{ref.key}: tensor {name!r} is not in {tref.holder.key}")
            t = holder[tref.name]
            got = xxhash.xxh64_intdigest(tensor_bytes(t, where=name)[0].data)
            if got != tref.xxh64:
                raise ChecksumMismatch(f"{ref.key}: referenced tensor {name!r} in "
                                       f"{tref.holder.key}", tref.xxh64, got)
            tensors[name] = t
            if progress is not None:
                progress(_nbytes((t,)))
        return tensors


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_raw_bytes(ref: BlobRef, total: int) -> None:
    """A whole blob decodes to exactly the raw bytes its manifest records."""
    if total != ref.raw_bytes:
        raise InvalidFormat(f"{ref.key}: decodes to {total} bytes, manifest records "
                            f"{ref.raw_bytes}")


def _decode_safetensors(data: bytes, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    try:
        tensors = safetensors.torch.load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    except Exception as err:
        raise InvalidFormat(f"{where}: not a valid safetensors blob ({err})") from None
    return skeleton_of(metadata, where), tensors


#: the blobs the current task is decoding, outermost first (each restore item is a task)
_CHAIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("mithril_chain",
                                                                          default=())


class BaseLoader:
    """``await loader(base, names)``: tensors ``names`` of the blob ``base`` names (a
    :data:`LoadBlob`); errors name ``needed_by``."""

    def __init__(self, catalog: RunCatalog, decoder: FreshDecoder, needed_by: str) -> None:
        self.catalog = catalog
        self.decoder = decoder
        self.needed_by = needed_by
        self._tensors: dict[str, dict[str, Any]] = {}
        self._refs: dict[str, BlobRef] = {}

    async def __call__(self, base: BaseRef, names: frozenset[str]) -> dict[str, Any]:
        path = _CHAIN.get()
        if base.key in path:  # hostile or damaged manifests: a chain must not loop
            raise InvalidFormat(f"{self.needed_by}: the chain of bases loops through "
                                f"{base.key} ({' -> '.join(path)})")
        have = self._tensors.setdefault(base.key, {})
        missing = names - have.keys()
        if not missing:
            return have
        # no lock per blob: a task holding one while waiting for another's could deadlock on
        # a damaged chain; two items asking the same blob at once (their chains are separate
        # blobs, so only a damaged run does) just decode it twice
        ref = await self._ref_of(base)
        token = _CHAIN.set((*path, base.key))
        try:
            _, tensors = await self.decoder.read(self.catalog.store, ref, self, only=missing)
        except KeyNotFound:
            raise MissingPrevious(f"{self.needed_by} needs {base.key} from version "
                                  f"{base.version_id}, whose blob is gone") from None
        finally:
            _CHAIN.reset(token)
        have.update(tensors)
        return have

    async def _ref_of(self, base: BaseRef) -> BlobRef:
        """The holder version's own record of the blob, checked against the reference."""
        ref = self._refs.get(base.key)
        if ref is not None and ref.xxh64 == base.xxh64:
            return ref
        try:
            holder = await self.catalog.read_manifest(
                self.catalog.layout.manifest_key(version_number(base.version_id)))
        except KeyNotFound:
            raise MissingPrevious(f"{self.needed_by} needs {base.key} from version "
                                  f"{base.version_id}, which is gone") from None
        found = next((b for b in holder.blobs() if b.key == base.key), None)
        if found is None or found.xxh64 != base.xxh64:
            raise MissingPrevious(f"{self.needed_by} needs {base.key} (xxh64 {base.xxh64}) "
                                  f"but version {base.version_id} holds "
                                  f"{'no such blob' if found is None else found.xxh64}")
        self._refs[base.key] = found
        return found
