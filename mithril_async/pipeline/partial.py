"""Ranged reads of the blocks of some tensors of an MCKP blob (a delta base's needed part).

Why: a delta version whose deltas need a few tensors of their base should not pay for reading
and hashing the whole base blob (an optimizer blob asked for one tensor would otherwise be read
and hashed whole, a large share of such a restore). The trailer, header and index are read and
checked by their own hashes (:class:`~mithril_async.codec.container.AsyncMckpRangeReader`), then
only the needed blocks, adjacent ones merged into one range and the ranges fetched concurrently;
each block's payload hash is checked before decoding and each decoded chunk's raw hash after, so
nothing unchecked is returned even though the whole-blob hash (which needs every byte) is not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection

from mithril_async.codec.container import AsyncMckpRangeReader, BlockRef, MckpInfo
from mithril_async.errors import InvalidFormat
from mithril_async.storage.base import Store

__all__ = ["PARTIAL_MAX_FRACTION", "read_partial"]

#: read by ranges only when the needed blocks are at most this fraction of the blob (beyond
#: it, one sequential read and one hash pass are as cheap and check more)
PARTIAL_MAX_FRACTION = 0.5

BlockBytes = Callable[[BlockRef], memoryview]


def _merge(blocks: list[BlockRef]) -> list[tuple[int, int]]:
    """Byte ranges ``(offset, length)`` covering ``blocks`` (sorted by offset), adjacent
    blocks merged."""
    spans: list[tuple[int, int]] = []
    for b in blocks:
        if spans and spans[-1][0] + spans[-1][1] == b.offset:
            spans[-1] = (spans[-1][0], spans[-1][1] + b.length)
        else:
            spans.append((b.offset, b.length))
    return spans


async def read_partial(store: Store, key: str, size: int, names: Collection[str]
                       ) -> tuple[MckpInfo, BlockBytes] | None:
    """Header/index of blob ``key`` and a supplier of the blocks of tensors ``names``; None
    when those blocks are more than :data:`PARTIAL_MAX_FRACTION` of the blob."""

    async def read_range(offset: int, length: int) -> bytes:
        return await store.get_range(key, offset, length)

    reader = AsyncMckpRangeReader(read_range, size)
    try:
        info = await reader.open()
    except InvalidFormat as err:
        raise InvalidFormat(f"{key}: {err}") from None
    wanted = {i for i, t in enumerate(info.tensors) if t.name in names}
    blocks = sorted((r for r in info.index.values() if r.tensor in wanted),
                    key=lambda r: r.offset)
    if sum(b.length for b in blocks) > PARTIAL_MAX_FRACTION * size:
        return None
    spans = _merge(blocks)
    datas = await asyncio.gather(*(read_range(o, n) for o, n in spans))
    where: dict[int, tuple[int, memoryview]] = {}  # block offset -> (span offset, span bytes)
    ordered = iter(blocks)
    for (off, n), data in zip(spans, datas, strict=True):
        if len(data) != n:
            raise InvalidFormat(f"{key}: ranged read of {n} bytes at {off} returned {len(data)}")
        mv = memoryview(data).cast("B")
        covered = 0
        while covered < n:  # the span's blocks, in order: they tile it exactly
            b = next(ordered)
            where[b.offset] = (off, mv)
            covered += b.length

    def block_bytes(ref: BlockRef) -> memoryview:
        off, mv = where[ref.offset]
        return mv[ref.offset - off:ref.offset - off + ref.length]

    return info, block_bytes
