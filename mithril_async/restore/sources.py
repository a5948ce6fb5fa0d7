"""Opening the blobs a restore reads: each checked once, before anything is written.

A blob is first checked against its manifest entry (:func:`check_size`: the store's size is
the recorded one, before a byte is read). Then, by format:

- MCKP (:func:`open_mckp`): trailer, header and index by ranged reads, each by its own hash;
  a blob that is a delta or references tensors its manifest entry does not name, or declares
  other raw bytes than recorded, is refused. For a one-pass restore the blocks must tile the
  data area (:func:`check_tiling`: every byte but the whole-blob hash is then under a hash the
  pass checks) and the header's step and item must be the manifest's (:func:`check_binding`:
  a blob of another version or item in its place is caught without its whole hash).
- safetensors (:func:`open_safetensors`): the header checked (every entry inside the data,
  none overlapping); its bytes are trusted only with the whole-file hash
  (:func:`verify_blob`), since the format has no per-block hashes.
- a part of an MCKP blob (:func:`read_partial`, a delta base asked for a few tensors): the
  header and index, then only the needed blocks, every one hashed before it is decoded.

:func:`verify_blob` streams a whole blob through its manifest hash with nothing written: the
``"whole"`` verify mode, and always for blobs without per-block hashes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import xxhash

from mithril_async.codec.container import FLAG_DELTA, PREAMBLE, BlockRef, MckpInfo
from mithril_async.codec.container_read import AsyncMckpRangeReader
from mithril_async.codec.safetensors_io import Entry, header_length, parse_header
from mithril_async.errors import ChecksumMismatch, InvalidFormat
from mithril_async.manifest import BlobRef
from mithril_async.pipeline.blobs import ITEM_KEY, REFS_KEY, skeleton_of
from mithril_async.restore.windows import (
    checked_read,
    group_windows,
    ordered_reads,
    pool_threads,
    range_reads,
    window_plan,
)
from mithril_async.storage.base import Store

__all__ = ["PARTIAL_MAX_FRACTION", "SafetensorsInfo", "check_binding", "check_size",
           "check_tiling", "open_mckp", "open_safetensors", "read_partial", "verify_blob"]

#: read by ranges only when the needed blocks are at most this fraction of the blob (beyond
#: it, one sequential read and one hash pass are as cheap and check more)
PARTIAL_MAX_FRACTION = 0.5


async def check_size(store: Store, ref: BlobRef) -> int:
    """The blob's size in the store, which must be its manifest's (checked before any read:
    a huge or truncated file costs nothing)."""
    size = await store.size(ref.key)
    if size != ref.bytes:
        raise InvalidFormat(f"{ref.key}: {size} bytes, manifest says {ref.bytes}")
    return size


async def open_mckp(store: Store, ref: BlobRef, size: int) -> MckpInfo:
    """Trailer, header and index of MCKP blob ``ref`` by ranged reads, each checked by its
    own hash; a blob that is a delta or references tensors its manifest entry does not name,
    or declares other raw bytes than recorded, is :class:`InvalidFormat`. Every byte is read
    once (the preamble is not fetched again with the header)."""
    got: dict[tuple[int, int], bytes] = {}  # (offset, length) -> bytes

    async def read_range(offset: int, length: int) -> bytes:
        pre = got.get((0, PREAMBLE.size))
        if offset == 0 and pre is not None and length > len(pre):  # the header: the rest
            data = pre + await store.get_range(ref.key, len(pre), length - len(pre))
        else:
            data = await store.get_range(ref.key, offset, length)
        got[(offset, length)] = data
        return data

    try:
        info = await AsyncMckpRangeReader(read_range, size).open()
    except ChecksumMismatch as err:  # name the blob: the piece's own message cannot
        raise ChecksumMismatch(f"{ref.key}: {err.where}", err.expected, err.actual) from None
    except InvalidFormat as err:
        raise type(err)(f"{ref.key}: {err}") from None
    if info.flags & FLAG_DELTA or info.metadata.get(REFS_KEY):
        raise InvalidFormat(f"{ref.key}: holds deltas or tensor references its manifest "
                            "entry does not name")
    if info.original_size != ref.raw_bytes:
        raise InvalidFormat(f"{ref.key}: its header declares {info.original_size} raw bytes, "
                            f"the manifest records {ref.raw_bytes}")
    return info


def check_tiling(key: str, info: MckpInfo, blocks: list[BlockRef]) -> None:
    """The blocks (sorted by offset) fill the data area exactly, as the writer lays them out:
    what a one-pass restore hashes window by window is then every byte of the blob."""
    at = info.data_start
    for b in blocks:
        if b.offset != at:
            raise InvalidFormat(f"{key}: {info.block_name(b.tensor, b.chunk)} starts at "
                                f"{b.offset}, the previous block ends at {at}")
        at += b.length
    if at != info.data_end:
        raise InvalidFormat(f"{key}: the blocks end at {at}, the index starts at "
                            f"{info.data_end}")


def check_binding(key: str, info: MckpInfo, step: int | None, item: str | None) -> None:
    """The blob's header records the version's step and the item it belongs to (where it
    records them): a blob of another version or item put in this one's place is caught
    without its whole hash."""
    if step is not None and info.training_step is not None and info.training_step != step:
        raise InvalidFormat(f"{key}: its header says step {info.training_step}, the manifest's is "
                            f"{step} (a blob of another version?)")
    saved = info.metadata.get(ITEM_KEY)
    if item is not None and saved is not None and saved != item:
        raise InvalidFormat(f"{key}: its header says item {saved!r}, the manifest lists it "
                            f"as {item!r}")


@dataclass
class SafetensorsInfo:
    """What the head of an uncompressed (safetensors) blob says: its tensors (``entries``,
    places within the data area), where its data area begins, its state skeleton, and the
    bytes before the data (hashed first by :meth:`hasher`)."""

    entries: list[Entry]
    data_start: int
    skeleton: Any
    head: bytes

    def hasher(self) -> Any:
        """An xxh64 that has seen every byte before the data area (the manifest's hash is
        of the whole file)."""
        h = xxhash.xxh64()
        h.update(self.head)
        return h


async def open_safetensors(store: Store, ref: BlobRef) -> SafetensorsInfo:
    """Read and check the header of safetensors blob ``ref`` by ranged reads (its length
    bounded by the blob's, JSON, every entry inside the data and none overlapping); its
    bytes are not hashed here: a caller trusts them only with the whole-file hash it checks
    (:func:`verify_blob`)."""
    size = ref.bytes
    head = await store.get_range(ref.key, 0, 8)
    hlen = header_length(head, size, ref.key)
    raw_header = await store.get_range(ref.key, 8, hlen)
    start = 8 + hlen
    entries, meta = parse_header(raw_header, size - start, ref.key)
    return SafetensorsInfo(entries, start, skeleton_of(meta, ref.key), head + raw_header)


async def verify_blob(store: Store, ref: BlobRef, pool: Any, budget: int) -> None:
    """Check blob ``ref``'s size and xxh64 against the manifest, streaming it through
    ``budget`` bytes (reads run ahead while earlier windows are hashed), with nothing
    written and no blob held."""
    size = await check_size(store, ref)
    h = xxhash.xxh64()
    loop = asyncio.get_running_loop()
    window, depth = window_plan(budget, pool_threads(pool))

    async def update(_off: int, data: bytes) -> None:
        await loop.run_in_executor(pool, h.update, data)

    async with range_reads(store, ref.key, pool) as read:
        await ordered_reads([(o, min(window, size - o)) for o in range(0, size, window)],
                            read, depth, update, ref.key)
    got = h.hexdigest()
    if got != ref.xxh64:
        raise ChecksumMismatch(ref.key, ref.xxh64, got)


BlockBytes = Callable[[BlockRef], memoryview]


async def read_partial(store: Store, key: str, size: int, names: Collection[str]
                       ) -> tuple[MckpInfo, BlockBytes] | None:
    """Header/index of blob ``key`` and a supplier of the blocks of tensors ``names``; None
    when those blocks are more than :data:`PARTIAL_MAX_FRACTION` of the blob. A delta
    version whose deltas need a few tensors of their base does not pay for reading and
    hashing the whole base: each block's payload hash is checked before decoding and each
    decoded chunk's hash after, so nothing unchecked is returned."""

    async def read_range(offset: int, length: int) -> bytes:
        return await store.get_range(key, offset, length)

    try:
        info = await AsyncMckpRangeReader(read_range, size).open()
    except InvalidFormat as err:
        raise InvalidFormat(f"{key}: {err}") from None
    wanted = {i for i, t in enumerate(info.tensors) if t.name in names}
    blocks = sorted((r for r in info.index.values() if r.tensor in wanted),
                    key=lambda r: r.offset)
    if sum(b.length for b in blocks) > PARTIAL_MAX_FRACTION * size:
        return None
    groups = group_windows(blocks, size)  # adjacent blocks merged into one read
    datas = await asyncio.gather(*(read_range(*span) for span, _ in groups))
    where: dict[int, tuple[int, memoryview]] = {}  # block offset -> (span offset, span bytes)
    for (span, group), data in zip(groups, datas, strict=True):
        mv = checked_read(key, span, data)
        for b in group:
            where[b.offset] = (span[0], mv)

    def block_bytes(ref: BlockRef) -> memoryview:
        off, mv = where[ref.offset]
        return mv[ref.offset - off:ref.offset - off + ref.length]

    return info, block_bytes
