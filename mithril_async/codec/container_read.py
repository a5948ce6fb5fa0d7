"""Validating readers of the MCKP blob format (its layout and writer:
:mod:`mithril_async.codec.container`): a whole blob in memory (:func:`parse_blob`), ranged
reads of trailer, header + index and any block (:class:`MckpRangeReader`,
:class:`AsyncMckpRangeReader`), one block's bytes (:func:`block_from_bytes`).

Readers validate every size and offset before using it (never allocate from an unvalidated
size), check every hash a ranged read can check, and refuse unknown versions.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import xxhash
import zstandard

from mithril_async.codec.chunk import (
    DELTA_BIT,
    ChunkMeta,
    chunk_hasher,
)
from mithril_async.codec.container import (
    BLOCK_FIXED,
    BLOCK_MAGIC,
    END_MAGIC,
    FLAG_DELTA,
    HASH,
    HEADER_EXPANSION,
    HEADER_SLACK,
    INDEX_ENTRY,
    KNOWN_FLAGS,
    MAGIC,
    MAX_HEADER_JSON,
    MAX_HEADER_STORED,
    MAX_PLANES,
    PLANE,
    PREAMBLE,
    READ_VERSIONS,
    TRAILER,
    TRAILER_SIZE,
    BlockRef,
    MckpInfo,
    TensorEntry,
)
from mithril_async.codec.transforms import REGISTRY
from mithril_async.errors import ChecksumMismatch, InvalidFormat, UnknownFormatVersion

__all__ = ["AsyncMckpRangeReader", "MckpRangeReader", "block_from_bytes", "parse_blob"]


@dataclass(frozen=True)
class _Trailer:
    header_length: int
    index_offset: int
    index_length: int
    index_count: int
    header_xxh64: int
    index_xxh64: int
    total_size: int
    version: int


def _known() -> str:
    return ", ".join(str(v) for v in READ_VERSIONS)


def _parse_trailer(tail: bytes | memoryview, total_size: int) -> _Trailer:
    """Validate the last ``TRAILER_SIZE`` bytes of a blob of ``total_size`` bytes."""
    if total_size < PREAMBLE.size + TRAILER_SIZE:
        raise InvalidFormat(f"blob of {total_size} bytes is too short to be MCKP")
    if len(tail) != TRAILER_SIZE:
        raise InvalidFormat(f"trailer read returned {len(tail)} bytes")
    tb = bytes(tail[:TRAILER.size])
    (hlen, ioff, ilen, icount, hxxh, ixxh, total, version, magic, txxh) = TRAILER.unpack(tb)
    if magic != END_MAGIC:
        raise InvalidFormat("trailer: bad end magic (truncated or not an MCKP blob)")
    got = xxhash.xxh64_intdigest(tb[:-HASH.size])
    if got != txxh:
        raise ChecksumMismatch("trailer", txxh, got)
    if version not in READ_VERSIONS:
        raise UnknownFormatVersion(f"trailer: MCKP version {version} (this reader knows "
                                   f"{_known()})")
    if total != total_size:
        raise InvalidFormat(f"trailer: blob declares {total} bytes but has {total_size}")
    if (ilen != icount * INDEX_ENTRY.size or ioff + ilen + TRAILER_SIZE != total
            or PREAMBLE.size + hlen > ioff):
        raise InvalidFormat("trailer: inconsistent header/index offsets")
    if hlen > MAX_HEADER_STORED:  # before a ranged reader fetches it
        raise InvalidFormat(f"trailer: header of {hlen} bytes (at most {MAX_HEADER_STORED})")
    return _Trailer(hlen, ioff, ilen, icount, hxxh, ixxh, total, version)


def _parse_head(head: bytes | memoryview, tr: _Trailer) -> tuple[int, int, dict[str, Any]]:
    """Validate preamble + header bytes; returns (version, flags, header JSON)."""
    if len(head) < PREAMBLE.size:
        raise InvalidFormat("blob too short for its preamble")
    magic, version, flags, hlen = PREAMBLE.unpack(bytes(head[:PREAMBLE.size]))
    if magic != MAGIC:
        raise InvalidFormat(f"bad magic {bytes(magic)!r}: not an MCKP blob")
    if version not in READ_VERSIONS:
        raise UnknownFormatVersion(f"MCKP version {version} (this reader knows {_known()})")
    if version != tr.version:
        raise InvalidFormat(f"preamble says MCKP version {version}, trailer {tr.version}")
    if hlen != tr.header_length or len(head) != PREAMBLE.size + hlen:
        raise InvalidFormat("preamble: header length disagrees with the trailer")
    got = xxhash.xxh64_intdigest(head)
    if got != tr.header_xxh64:
        raise ChecksumMismatch("blob header", tr.header_xxh64, got)
    if flags & ~KNOWN_FLAGS:
        raise InvalidFormat(f"preamble: unknown flags {flags:#x}")
    try:
        dctx = zstandard.ZstdDecompressor()
        size = zstandard.frame_content_size(head[PREAMBLE.size:])
        limit = min(MAX_HEADER_JSON, HEADER_EXPANSION * hlen + HEADER_SLACK)
        if not 0 <= size <= limit:  # before decompressing or parsing anything
            raise InvalidFormat(f"blob header of {hlen} bytes declares {size} bytes of JSON "
                                f"(at most {limit} for its size)")
        header = json.loads(dctx.decompress(head[PREAMBLE.size:], max_output_size=size))
    except (zstandard.ZstdError, ValueError) as e:
        raise InvalidFormat(f"blob header does not decode: {e}") from None
    if not isinstance(header, dict) or header.get("format") != "mckp":
        raise InvalidFormat("blob header is not an MCKP header")
    if header.get("version") != version:
        raise UnknownFormatVersion(f"MCKP header version {header.get('version')} (preamble "
                                   f"says {version})")
    return version, flags, header


def _build_info(version: int, flags: int, header: dict[str, Any], tr: _Trailer) -> MckpInfo:
    raw_tensors = header.get("tensors")
    if not isinstance(raw_tensors, list):
        raise InvalidFormat("blob header: 'tensors' is not a list")
    tensors = tuple(TensorEntry.from_json(d, i) for i, d in enumerate(raw_tensors))
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise InvalidFormat("blob header: duplicate tensor names")
    orig = header.get("original_size")
    if orig != sum(t.nbytes for t in tensors):
        raise InvalidFormat("blob header: original_size disagrees with the tensors")
    if bool(flags & FLAG_DELTA) != any(t.base_xxh64 is not None for t in tensors):
        raise InvalidFormat("blob header: has_delta flag disagrees with the tensors")
    params = header.get("compression_params")
    meta = header.get("metadata")
    step = header.get("training_step")
    prev = header.get("previous_checkpoint_hash")
    if (not isinstance(params, dict) or not isinstance(meta, dict)
            or not (step is None or type(step) is int)
            or not (prev is None or isinstance(prev, str))):
        raise InvalidFormat("blob header: malformed params/metadata/step/previous hash")
    if tr.index_count != sum(len(t.chunks) for t in tensors):
        raise InvalidFormat(f"index holds {tr.index_count} blocks, header implies "
                            f"{sum(len(t.chunks) for t in tensors)}")
    return MckpInfo(version, flags, tensors, params, orig, prev, step, meta, {},
                    tr.total_size, PREAMBLE.size + tr.header_length, tr.index_offset)


def _parse_index(data: bytes | memoryview, tr: _Trailer, info: MckpInfo) -> None:
    """Validate the index and fill ``info.index`` (every block once, inside the data area)."""
    if len(data) != tr.index_length:
        raise InvalidFormat("index read returned the wrong length")
    got = xxhash.xxh64_intdigest(data)
    if got != tr.index_xxh64:
        raise ChecksumMismatch("block index", tr.index_xxh64, got)
    min_block = BLOCK_FIXED.size + HASH.size
    for ti, ci, off, ln in INDEX_ENTRY.iter_unpack(data):
        where = info.block_name(ti, ci)
        if not (0 <= ti < len(info.tensors) and 0 <= ci < len(info.tensors[ti].chunks)):
            raise InvalidFormat(f"index names a block that does not exist: {where}")
        if off < info.data_start or ln < min_block or off + ln > info.data_end:
            raise InvalidFormat(f"index: {where} points outside the data area")
        if (ti, ci) in info.index:
            raise InvalidFormat(f"index: {where} listed twice")
        info.index[(ti, ci)] = BlockRef(ti, ci, off, ln)


def block_from_bytes(data: bytes | memoryview, ref: BlockRef, info: MckpInfo, *,
                     verify_payload: bool = True) -> tuple[ChunkMeta, memoryview]:
    """Validate one block (``ref.length`` bytes) and split it into metadata and payload.

    The payload hash is checked here (unless ``verify_payload`` is false: a caller that has
    checked a hash over the whole blob), so a caller may decode with ``verify_payload=False``.
    """
    where = info.block_name(ref.tensor, ref.chunk)
    mv = memoryview(data).cast("B")
    if len(mv) != ref.length:
        raise InvalidFormat(f"{where}: read returned {len(mv)} of {ref.length} bytes")
    (magic, ti, ci, transform, width, nplanes, raw_size, stored_size, raw_xxh,
     pay_xxh) = BLOCK_FIXED.unpack_from(mv, 0)
    if magic != BLOCK_MAGIC or nplanes > MAX_PLANES:
        raise InvalidFormat(f"{where}: bad block header at offset {ref.offset}")
    hlen = BLOCK_FIXED.size + nplanes * PLANE.size + HASH.size
    if hlen > len(mv):
        raise InvalidFormat(f"{where}: block header overruns the block")
    (stored_hash,) = HASH.unpack_from(mv, hlen - HASH.size)
    got = xxhash.xxh64_intdigest(mv[:hlen - HASH.size])
    if got != stored_hash:
        raise ChecksumMismatch(f"{where} header", stored_hash, got)
    if (ti, ci) != (ref.tensor, ref.chunk):
        raise InvalidFormat(f"{where}: index points at block ({ti}, {ci})")
    planes = tuple(PLANE.unpack_from(mv, BLOCK_FIXED.size + i * PLANE.size)
                   for i in range(nplanes))
    t = info.tensors[ti]
    if raw_size != t.chunks[ci][1]:
        raise InvalidFormat(f"{where}: raw size {raw_size} disagrees with the header span")
    if stored_size != ref.length - hlen or sum(s for _, s in planes) != stored_size:
        raise InvalidFormat(f"{where}: stored size disagrees with the block length")
    if bool(transform & DELTA_BIT) != (t.base_xxh64 is not None):
        raise InvalidFormat(f"{where}: delta flag disagrees with the tensor entry")
    if transform & ~DELTA_BIT not in REGISTRY:
        raise InvalidFormat(f"{where}: unknown transform {transform}")
    payload = mv[hlen:]
    if verify_payload:
        got = chunk_hasher(info.version)(payload)
        if got != pay_xxh:
            raise ChecksumMismatch(f"{where} payload", pay_xxh, got)
    return ChunkMeta(transform, width, raw_size, raw_xxh, pay_xxh, planes, info.version), payload


# ---------------------------------------------------------------- readers


def parse_blob(blob: bytes | bytearray | memoryview, *, verify: bool = True) -> MckpInfo:
    """Validate a whole blob in memory and return its header and index.

    ``verify`` also checks the whole-blob xxh64 (one fast pass; catches a flip anywhere).
    """
    mv = memoryview(blob).cast("B")
    n = len(mv)
    if n < PREAMBLE.size + TRAILER_SIZE:
        if n >= 4 and bytes(mv[:4]) != MAGIC:
            raise InvalidFormat(f"bad magic {bytes(mv[:4])!r}: not an MCKP blob")
        raise InvalidFormat(f"blob of {n} bytes is too short to be MCKP")
    if bytes(mv[:4]) != MAGIC:
        raise InvalidFormat(f"bad magic {bytes(mv[:4])!r}: not an MCKP blob")
    if verify:
        (want,) = HASH.unpack_from(mv, n - HASH.size)
        got = xxhash.xxh64_intdigest(mv[:n - HASH.size])
        if got != want:
            raise ChecksumMismatch("whole blob (xxh64)", want, got)
    tr = _parse_trailer(mv[n - TRAILER_SIZE:], n)
    version, flags, header = _parse_head(mv[:PREAMBLE.size + tr.header_length], tr)
    info = _build_info(version, flags, header, tr)
    _parse_index(mv[tr.index_offset:tr.index_offset + tr.index_length], tr, info)
    return info


def _parse_preamble_len(pre: bytes | memoryview) -> int:
    if len(pre) != PREAMBLE.size:
        raise InvalidFormat("short read of the preamble")
    magic, version, _flags, hlen = PREAMBLE.unpack(bytes(pre))
    if magic != MAGIC:
        raise InvalidFormat(f"bad magic {bytes(magic)!r}: not an MCKP blob")
    if version not in READ_VERSIONS:
        raise UnknownFormatVersion(f"MCKP version {version} (this reader knows {_known()})")
    return int(hlen)


class MckpRangeReader:
    """Reads a blob through ``read_range(offset, length) -> bytes`` (e.g. a ranged GET).

    ``open()`` reads the trailer, then the preamble + header and the index (3 reads);
    ``read_block`` then fetches and validates one block, so blocks can be fetched in
    parallel.  The whole-blob hash is not checked (it would need every byte); every piece is
    covered by its own hash instead.
    """

    def __init__(self, read_range: Callable[[int, int], bytes | memoryview], size: int) -> None:
        self._read = read_range
        self.size = size
        self.info: MckpInfo | None = None

    def open(self) -> MckpInfo:
        if self.size < PREAMBLE.size + TRAILER_SIZE:
            raise InvalidFormat(f"blob of {self.size} bytes is too short to be MCKP")
        pre = self._read(0, PREAMBLE.size)
        _parse_preamble_len(pre)
        tr = _parse_trailer(self._read(self.size - TRAILER_SIZE, TRAILER_SIZE), self.size)
        head = self._read(0, PREAMBLE.size + tr.header_length)
        version, flags, header = _parse_head(head, tr)
        info = _build_info(version, flags, header, tr)
        _parse_index(self._read(tr.index_offset, tr.index_length), tr, info)
        self.info = info
        return info

    def read_block(self, tensor: int, chunk: int) -> tuple[ChunkMeta, memoryview]:
        info = self.info if self.info is not None else self.open()
        ref = info.index[(tensor, chunk)]
        return block_from_bytes(self._read(ref.offset, ref.length), ref, info)


class AsyncMckpRangeReader:
    """:class:`MckpRangeReader` over an async ``read_range`` (aioboto3 / aiofiles)."""

    def __init__(self, read_range: Callable[[int, int], Awaitable[bytes | memoryview]],
                 size: int) -> None:
        self._read = read_range
        self.size = size
        self.info: MckpInfo | None = None

    async def open(self) -> MckpInfo:
        if self.size < PREAMBLE.size + TRAILER_SIZE:
            raise InvalidFormat(f"blob of {self.size} bytes is too short to be MCKP")
        _parse_preamble_len(await self._read(0, PREAMBLE.size))
        tr = _parse_trailer(await self._read(self.size - TRAILER_SIZE, TRAILER_SIZE), self.size)
        version, flags, header = _parse_head(
            await self._read(0, PREAMBLE.size + tr.header_length), tr)
        info = _build_info(version, flags, header, tr)
        _parse_index(await self._read(tr.index_offset, tr.index_length), tr, info)
        self.info = info
        return info

    async def read_block(self, tensor: int, chunk: int) -> tuple[ChunkMeta, memoryview]:
        info = self.info if self.info is not None else await self.open()
        ref = info.index[(tensor, chunk)]
        return block_from_bytes(await self._read(ref.offset, ref.length), ref, info)
