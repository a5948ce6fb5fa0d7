"""The MCKP blob format: its layout and a streaming, sans-IO writer (the validating readers:
:mod:`mithril_async.codec.container_read`).

Layout (exact bytes in ``docs/FORMAT.md``)::

    preamble  "MCKP" u32 version u32 flags u32 header_length          16 bytes
    header    zstd(JSON): tensors, chunk spans, params, step, ...     header_length bytes
    blocks    block header ("MBLK" ..., plane table, xxh64) + payload   any order
              (chunk raw/payload hashes: XXH3-64 in version 2, XXH64 in version 1)
    index     one 24-byte entry per block: tensor, chunk, offset, length
    trailer   offsets/lengths, hashes of header/index/trailer, total size, "MCKE",
              xxh64 of every preceding byte                           80 bytes

Why this shape: the writer is sans-IO and streaming (``begin``/``add``/``finish`` return the
bytes to append), so the manager can push pieces to a file or an S3 multipart upload as chunks
finish compressing, in any order.  The fixed-size trailer lets a reader holding only ranged
reads fetch trailer -> header + index -> any block, so restores parallelise over blocks.
Every byte is covered by a hash a ranged reader can check without reading the rest (preamble +
header, index, trailer, each block header, each payload, each decoded chunk), and the whole
blob has an xxh64 for whole-file verification.  Readers validate every size and offset
before using it (never allocate from an unvalidated size) and refuse unknown versions.
Writers write version 2; readers read 1 and 2 (they differ only in the chunk hash function).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zstandard

from mithril_async.codec.chunk import (
    CHUNK_HASH_VERSION,
    CodecParams,
    EncodedChunk,
    chunk_spans,
)
from mithril_async.codec.dtypes import dtype_info
from mithril_async.errors import InvalidFormat

__all__ = [
    "FLAG_BYTE_GROUPING",
    "FLAG_DELTA",
    "FLAG_QUANTIZATION",
    "MAGIC",
    "READ_VERSIONS",
    "VERSION",
        "BlockRef",
    "MckpInfo",
    "MckpWriter",
    "TensorEntry",
]

MAGIC = b"MCKP"
END_MAGIC = b"MCKE"
BLOCK_MAGIC = b"MBLK"
#: The version writers write; readers accept every version in READ_VERSIONS.
VERSION = 2
READ_VERSIONS = (1, 2)
assert VERSION == CHUNK_HASH_VERSION  # the blocks a writer takes carry this version's hashes
FLAG_DELTA = 1 << 0
FLAG_BYTE_GROUPING = 1 << 1
FLAG_QUANTIZATION = 1 << 2
KNOWN_FLAGS = FLAG_DELTA | FLAG_BYTE_GROUPING | FLAG_QUANTIZATION

PREAMBLE = struct.Struct("<4sIII")  # magic, version, flags, header_length
BLOCK_FIXED = struct.Struct("<4sIIBBHQQQQ")  # magic, tensor, chunk, transform, width, nplanes,
#                                               raw_size, stored_size, raw_xxh64, payload_xxh64
PLANE = struct.Struct("<BQ")  # method, stored length
HASH = struct.Struct("<Q")
INDEX_ENTRY = struct.Struct("<IIQQ")  # tensor, chunk, offset, length (header + payload)
TRAILER = struct.Struct("<QQQQQQQI4sQ")  # header_length, index_offset, index_length,
#   index_count, header_xxh64, index_xxh64, total_size, version, "MCKE", trailer_xxh64
TRAILER_SIZE = TRAILER.size + HASH.size  # + xxh64 of all preceding bytes of the blob
MAX_PLANES = 32
#: bounds on a header, checked before it is decompressed and parsed: its stored (zstd) size,
#: and its JSON size, which may be at most HEADER_EXPANSION x the stored size (plus
#: HEADER_SLACK, for small headers whose skeleton repeats a value) and never above
#: MAX_HEADER_JSON. Parsed JSON costs up to ~24x its size in Python objects, so a 44 KB header
#: claiming 45 MB of ``[[],[],...]`` would cost ~1 GB; real headers compress 5-50x (tensor
#: tables, optimizer skeletons; measured on GPT-2-like models with AdamW state).
MAX_HEADER_STORED = 64 << 20
HEADER_EXPANSION = 128
HEADER_SLACK = 1 << 20
MAX_HEADER_JSON = 256 << 20
MAX_CHUNK = (1 << 30) + 64  # no chunk is longer (CodecParams.chunk_bytes <= 1 GiB)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header records it.

    ``chunks``: ``[(offset, length), ...]`` covering ``[0, nbytes)`` in order.  ``base_xxh64``:
    xxh64 of the base tensor's raw bytes when this tensor is stored as an XOR delta.
    ``extra``: free-form per-tensor JSON (e.g. ``{"numpy": true}``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[tuple[int, int], ...]
    base_xxh64: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, name: str, dtype: str, shape: Iterable[int], chunk_bytes: int,
             base_xxh64: int | None = None, extra: dict[str, Any] | None = None,
             ) -> TensorEntry:
        """An entry with chunk spans computed by :func:`chunk_spans`."""
        info = dtype_info(dtype, where=name)
        shp = tuple(int(s) for s in shape)
        n = info.itemsize
        for s in shp:
            n *= s
        return cls(name, dtype, shp, n, tuple(chunk_spans(n, info.itemsize, chunk_bytes)),
                   base_xxh64, dict(extra or {}))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                             "nbytes": self.nbytes, "chunks": [list(c) for c in self.chunks]}
        if self.base_xxh64 is not None:
            d["base_xxh64"] = f"{self.base_xxh64:016x}"
        if self.extra:
            d["extra"] = self.extra
        return d

    @classmethod
    def from_json(cls, d: Any, i: int) -> TensorEntry:
        """Validate one header entry (every field, every span) and build it."""
        where = f"header tensor #{i}"
        try:
            name = d["name"]
            if not isinstance(name, str):
                raise TypeError("name")
            where = f"header tensor {name!r}"
            info = dtype_info(d["dtype"], where=where)
            shape = tuple(d["shape"])
            nbytes = d["nbytes"]
            chunks = tuple((c[0], c[1]) for c in d["chunks"])
            base = d.get("base_xxh64")
            extra = d.get("extra", {})
            ints = [*shape, nbytes, *(x for c in chunks for x in c)]
            if not all(type(x) is int and x >= 0 for x in ints) or not isinstance(extra, dict):
                raise TypeError("types")
            base_int = int(base, 16) if base is not None else None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise InvalidFormat(f"{where}: malformed tensor metadata ({e})") from None
        n = info.itemsize
        for s in shape:
            n *= s
        if n != nbytes:
            raise InvalidFormat(f"{where}: nbytes {nbytes} != {info.itemsize} * {list(shape)}")
        pos = 0
        for off, ln in chunks:
            if off != pos or ln == 0 or ln % info.itemsize or ln > MAX_CHUNK:
                raise InvalidFormat(f"{where}: chunk spans do not tile the tensor")
            pos += ln
        if pos != nbytes:
            raise InvalidFormat(f"{where}: chunk spans cover {pos} of {nbytes} bytes")
        return cls(name, info.name, shape, nbytes, chunks, base_int, extra)


@dataclass(frozen=True)
class BlockRef:
    """Where a block lives in the blob: ``[offset, offset + length)``."""

    tensor: int
    chunk: int
    offset: int
    length: int


@dataclass(frozen=True)
class MckpInfo:
    """A validated blob header plus its block index."""

    version: int
    flags: int
    tensors: tuple[TensorEntry, ...]
    params: dict[str, Any]
    original_size: int
    previous_checkpoint_hash: str | None
    training_step: int | None
    metadata: dict[str, Any]
    index: dict[tuple[int, int], BlockRef]
    total_size: int
    data_start: int
    data_end: int

    def block_name(self, tensor: int, chunk: int) -> str:
        name = self.tensors[tensor].name if 0 <= tensor < len(self.tensors) else f"#{tensor}"
        return f"block (tensor {name!r}, chunk {chunk})"


class MckpWriter:
    """Streaming, sans-IO writer: append ``begin()``, every ``add()``, then ``finish()``.

    Blocks may be added in any order; ``finish`` refuses to close a blob with missing or
    duplicate blocks.  ``size`` is the number of bytes produced so far and, after ``finish``,
    ``xxh64`` the hash of the whole blob (what a manifest should record).
    """

    def __init__(self, tensors: Iterable[TensorEntry], *, params: CodecParams | dict[str, Any],
                 previous_checkpoint_hash: str | None = None, training_step: int | None = None,
                 metadata: dict[str, Any] | None = None, quantized: bool = False) -> None:
        self.tensors = tuple(tensors)
        pdict = params.to_dict() if isinstance(params, CodecParams) else dict(params)
        self.flags = (
            (FLAG_DELTA if any(t.base_xxh64 is not None for t in self.tensors) else 0)
            | (FLAG_BYTE_GROUPING if pdict.get("byte_grouping") else 0)
            | (FLAG_QUANTIZATION if quantized else 0))
        header = {
            "format": "mckp", "version": VERSION,
            "original_size": sum(t.nbytes for t in self.tensors),
            "tensors": [t.to_json() for t in self.tensors],
            "compression_params": pdict,
            "previous_checkpoint_hash": previous_checkpoint_hash,
            "training_step": training_step,
            "metadata": metadata or {},
        }
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        self._header = zstandard.ZstdCompressor(level=3).compress(raw)
        self._hasher = xxhash.xxh64()
        self._size = 0
        self._index: list[bytes] = []
        self._seen: set[tuple[int, int]] = set()
        self._state = "new"
        self._header_xxh = 0
        self._xxh: int | None = None

    @property
    def size(self) -> int:
        return self._size

    @property
    def xxh64(self) -> int:
        if self._xxh is None:
            raise RuntimeError("MckpWriter.xxh64 is known only after finish()")
        return self._xxh

    def _emit(self, data: Any) -> Any:
        self._hasher.update(data)
        self._size += memoryview(data).nbytes
        return data

    def begin(self) -> bytes:
        """Preamble and header: the first bytes of the blob."""
        if self._state != "new":
            raise RuntimeError("MckpWriter.begin() called twice")
        self._state = "open"
        out = PREAMBLE.pack(MAGIC, VERSION, self.flags, len(self._header)) + self._header
        self._header_xxh = xxhash.xxh64_intdigest(out)
        return self._emit(out)

    def add(self, tensor_index: int, chunk_index: int, encoded: EncodedChunk) -> bytes:
        """Block header + payload of one encoded chunk (append them right after)."""
        return b"".join(self.add_parts(tensor_index, chunk_index, encoded))

    def add_parts(self, tensor_index: int, chunk_index: int, encoded: EncodedChunk,
                  ) -> tuple[Any, ...]:
        """As :meth:`add`, but the block as separate buffers: its header, then its payload
        (one buffer where the coder made one, ``EncodedChunk.span``, else each plane).

        For callers that concatenate the whole blob anyway: skips one copy of every block.
        """
        if self._state != "open":
            raise RuntimeError("MckpWriter.add() outside begin()/finish()")
        if not 0 <= tensor_index < len(self.tensors):
            raise ValueError(f"tensor index {tensor_index} out of range")
        t = self.tensors[tensor_index]
        if not 0 <= chunk_index < len(t.chunks):
            raise ValueError(f"{t.name!r}: chunk index {chunk_index} out of range")
        key = (tensor_index, chunk_index)
        if key in self._seen:
            raise ValueError(f"{t.name!r}: chunk {chunk_index} added twice")
        m = encoded.meta
        if m.raw_size != t.chunks[chunk_index][1]:
            raise ValueError(f"{t.name!r}: chunk {chunk_index} has {m.raw_size} bytes, span "
                             f"says {t.chunks[chunk_index][1]}")
        if m.is_delta != (t.base_xxh64 is not None):
            raise ValueError(f"{t.name!r}: chunk delta-ness disagrees with the tensor entry")
        if m.hash_version != VERSION:
            raise ValueError(f"{t.name!r}: chunk {chunk_index} carries MCKP version "
                             f"{m.hash_version} hashes, this writer writes version {VERSION}")
        if [len(memoryview(x).cast("B")) for x in encoded.parts] != [n for _, n in m.planes]:
            raise ValueError(f"{t.name!r}: payload length disagrees with its plane table")
        self._seen.add(key)
        head = BLOCK_FIXED.pack(BLOCK_MAGIC, tensor_index, chunk_index, m.transform, m.width,
                                len(m.planes), m.raw_size, m.stored_size, m.raw_xxh64,
                                m.payload_xxh64)
        head += b"".join(PLANE.pack(meth, ln) for meth, ln in m.planes)
        head += HASH.pack(xxhash.xxh64_intdigest(head))
        self._index.append(INDEX_ENTRY.pack(tensor_index, chunk_index, self._size,
                                            len(head) + m.stored_size))
        # the payload as one buffer where the coder made it so (one hash call, one copy)
        parts = (head, encoded.span) if encoded.span is not None else (head, *encoded.parts)
        for part in parts:
            self._emit(part)
        return parts

    def finish(self) -> bytes:
        """Index and trailer: the last bytes of the blob."""
        if self._state != "open":
            raise RuntimeError("MckpWriter.finish() outside begin()")
        want = sum(len(t.chunks) for t in self.tensors)
        if len(self._seen) != want:
            missing = next((ti, ci) for ti, t in enumerate(self.tensors)
                           for ci in range(len(t.chunks)) if (ti, ci) not in self._seen)
            raise ValueError(f"blob incomplete: {want - len(self._seen)} blocks missing, e.g. "
                             f"tensor {self.tensors[missing[0]].name!r} chunk {missing[1]}")
        self._state = "done"
        index = b"".join(self._index)
        index_offset = self._size
        total = index_offset + len(index) + TRAILER_SIZE
        body = TRAILER.pack(len(self._header), index_offset, len(index), len(self._index),
                            self._header_xxh, xxhash.xxh64_intdigest(index), total, VERSION,
                            END_MAGIC, 0)[:-HASH.size]
        trailer = body + HASH.pack(xxhash.xxh64_intdigest(body))
        self._emit(index)
        self._emit(trailer)
        tail = HASH.pack(self._hasher.intdigest())
        self._emit(tail)
        self._xxh = self._hasher.intdigest()
        return index + trailer + tail


# ---------------------------------------------------------------- sans-IO parsing steps
