"""HPΔKV: the residual container for 4-bit quantised weights version 1.

Why a separate tiny format: a 4-bit copy of a model is what most users load, and the residual
("what the 4-bit copy got wrong") is what a few users need to get back to the original. Keeping
the residual in its own self-describing blob lets it be fetched, mmapped or dropped on its own.

Byte layout (little-endian; see docs/FORMAT.md (HPΔKV section))::

    0   4          magic  b"HPDV"
    4   1          version (1)
    5   1          dtype   (0 = FP16, 1 = BF16)
    6   1          rank    (0..255)
    7   1          flags   (bit 0: index block present, bit 1: zlib payload; others must be 0)
    8   4*rank     shape   uint32 per dimension
    ..  0..15      zero padding up to a multiple of 16 bytes
    [index block]  uint32 k, then k uint32 flat indices (strictly increasing)
    payload        k (sparse) or prod(shape) (dense) 16-bit values, raw or one zlib stream

The reader trusts nothing: every size it allocates is first checked against the bytes actually
present (or, for a zlib payload, against zlib's maximum expansion ratio and a bounded
decompression), so a corrupt or hostile blob raises :class:`InvalidFormat` /
:class:`UnknownFormatVersion` and never crashes or balloons memory.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from mithril_async.errors import InvalidFormat, UnknownFormatVersion, UnsupportedDtype

MAGIC = b"HPDV"
VERSION = 1
FLAG_INDICES = 0x01
FLAG_ZLIB = 0x02
_KNOWN_FLAGS = FLAG_INDICES | FLAG_ZLIB
_DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 0, torch.bfloat16: 1}
_CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in _DTYPE_CODES.items()}
_ALIGN = 16
_MAX_DIM = 0xFFFFFFFF
#: Flat indices are uint32, so a sparse blob can address at most this many elements.
MAX_INDEXABLE = 1 << 32
#: Default cap on the elements a reader will materialise; callers may raise it.
DEFAULT_MAX_ELEMENTS = 1 << 31
#: zlib (deflate) cannot expand its input by more than ~1032:1; used to reject absurd claims
#: before decompressing anything.
_ZLIB_MAX_RATIO = 1032

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "FLAG_INDICES",
    "FLAG_ZLIB",
    "MAGIC",
    "VERSION",
    "estimate_hpdkv_size",
    "header_size",
    "pack_residuals",
    "unpack_residuals",
]


def header_size(rank: int) -> int:
    """Bytes before the index block / payload: 8 fixed + 4 per dim, padded to 16."""
    raw = 8 + 4 * rank
    return (raw + _ALIGN - 1) // _ALIGN * _ALIGN


def _topk_count(n: int, store_topk: float) -> int:
    if isinstance(store_topk, bool) or not isinstance(store_topk, int | float):
        raise TypeError(f"store_topk must be a fraction in [0, 1], got {store_topk!r}")
    if not 0.0 <= float(store_topk) <= 1.0 or math.isnan(store_topk):
        raise ValueError(f"store_topk must be a fraction in [0, 1], got {store_topk!r}")
    return min(n, math.ceil(float(store_topk) * n))


def _select_topk(values: torch.Tensor, k: int, scores: torch.Tensor | None) -> torch.Tensor:
    """Flat int64 indices (ascending) of the k largest |scores| (|values| when None).

    Ranking runs in float32 because CPU ``topk`` lacks half support.
    NaN scores rank as the largest so a NaN residual is never silently dropped.
    """
    key = (values if scores is None else scores).reshape(-1).to(torch.float32).abs()
    key = torch.nan_to_num(key, nan=math.inf)
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    idx = torch.topk(key, k, largest=True, sorted=False).indices
    return torch.sort(idx).values


def pack_residuals(
    residual: torch.Tensor,
    store_topk: float | None = None,
    compress: bool = False,
    *,
    scores: torch.Tensor | None = None,
) -> bytes:
    """Serialise an FP16/BF16 residual tensor as an HPΔKV v1 blob.

    ``store_topk`` keeps only the ``ceil(fraction * numel)`` elements with the largest
    magnitude (an index block is written); ``None`` stores the dense tensor. ``scores``
    (same numel) ranks elements instead of ``|residual|`` — used when the stored words are
    not themselves magnitudes (e.g. the XOR residual of :mod:`mithril_async.lossy.nf4`).
    ``compress`` zlib-compresses the payload only; the header and index block stay raw so
    they can be read without inflating anything.
    """
    if residual.dtype not in _DTYPE_CODES:
        raise UnsupportedDtype(
            f"HPΔKV stores float16/bfloat16 residuals only, got {residual.dtype}"
        )
    if residual.dim() > 255:
        raise ValueError(f"HPΔKV rank is at most 255, got {residual.dim()}")
    shape = tuple(int(d) for d in residual.shape)
    if any(d > _MAX_DIM for d in shape):
        raise ValueError(f"HPΔKV dimensions are uint32, got shape {shape}")
    flat = residual.detach().to("cpu").contiguous().reshape(-1)
    n = flat.numel()
    flags = 0
    index_block = b""
    if store_topk is not None:
        if n > MAX_INDEXABLE:
            raise ValueError(f"{n} elements exceed the uint32 index range; shard the tensor")
        if scores is not None and scores.numel() != n:
            raise ValueError(f"scores has {scores.numel()} elements, residual has {n}")
        idx = _select_topk(flat, _topk_count(n, store_topk), scores)
        flat = flat[idx]
        flags |= FLAG_INDICES
        index_block = struct.pack("<I", idx.numel()) + idx.numpy().astype("<u4").tobytes()
    payload = flat.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    if compress:
        flags |= FLAG_ZLIB
        payload = zlib.compress(payload)
    head = MAGIC + struct.pack("<BBBB", VERSION, _DTYPE_CODES[residual.dtype], len(shape), flags)
    head += struct.pack(f"<{len(shape)}I", *shape)
    head += b"\x00" * (header_size(len(shape)) - len(head))
    return head + index_block + payload


def _parse_header(view: memoryview) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if len(view) < 8:
        raise InvalidFormat(f"HPΔKV blob of {len(view)} bytes is shorter than its 8-byte header")
    if bytes(view[:4]) != MAGIC:
        raise InvalidFormat(f"HPΔKV magic mismatch: {bytes(view[:4])!r} != {MAGIC!r}")
    version, dtype_code, rank, flags = struct.unpack_from("<BBBB", view, 4)
    if version != VERSION:
        raise UnknownFormatVersion(f"HPΔKV version {version} is not known (reader knows 1)")
    if dtype_code not in _CODE_DTYPES:
        raise InvalidFormat(f"HPΔKV dtype code {dtype_code} is not 0 (FP16) or 1 (BF16)")
    if flags & ~_KNOWN_FLAGS:
        raise InvalidFormat(f"HPΔKV flags 0x{flags:02x} set unknown bits")
    hsize = header_size(rank)
    if len(view) < hsize:
        raise InvalidFormat(f"HPΔKV blob of {len(view)} bytes truncates its {hsize}-byte header")
    shape = struct.unpack_from(f"<{rank}I", view, 8)
    if any(view[8 + 4 * rank : hsize]):
        raise InvalidFormat("HPΔKV header padding is not zero")
    return _CODE_DTYPES[dtype_code], tuple(shape), flags, hsize


def _payload_bytes(body: memoryview, count: int, compressed: bool) -> bytes:
    """Exactly ``2 * count`` payload bytes, validated before anything of that size exists."""
    expected = 2 * count
    if not compressed:
        if len(body) != expected:
            raise InvalidFormat(f"HPΔKV payload is {len(body)} bytes, shape says {expected}")
        return bytes(body)
    if expected > _ZLIB_MAX_RATIO * len(body) + 64:
        raise InvalidFormat(
            f"HPΔKV zlib payload of {len(body)} bytes cannot inflate to {expected} bytes"
        )
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(body, expected + 1)
    except zlib.error as exc:
        raise InvalidFormat(f"HPΔKV zlib payload is corrupt: {exc}") from exc
    if len(out) != expected or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise InvalidFormat(
            f"HPΔKV zlib payload inflates to {len(out)}+ bytes (eof={inflater.eof}), "
            f"expected exactly {expected} with nothing after the stream"
        )
    return out


def _words_to_tensor(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    words = np.frombuffer(raw, dtype="<i2").astype(np.int16, copy=True)
    return torch.from_numpy(words).view(dtype)


def unpack_residuals(blob: bytes, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
    """Parse an HPΔKV v1 blob back into a tensor (zeros where a sparse blob stores nothing).

    Raises :class:`UnknownFormatVersion` for another version and :class:`InvalidFormat` for
    anything malformed: bad magic/dtype/flags, non-zero padding, a payload whose length does not
    match the declared shape (or ``k``), indices out of range or not strictly increasing,
    trailing bytes, corrupt zlib. ``max_elements`` caps what a sparse blob (whose size is not
    otherwise tied to its length) may make the reader allocate.
    """
    view = memoryview(bytes(blob))
    dtype, shape, flags, pos = _parse_header(view)
    n = math.prod(shape)
    if n > max_elements:
        raise InvalidFormat(f"HPΔKV shape {shape} has {n} elements, over the cap {max_elements}")
    if math.prod(max(d, 1) for d in shape) >= 1 << 63:  # an empty tensor with huge dims
        raise InvalidFormat(f"HPΔKV shape {shape}: its strides overflow int64")
    compressed = bool(flags & FLAG_ZLIB)
    if not flags & FLAG_INDICES:
        return _words_to_tensor(_payload_bytes(view[pos:], n, compressed), dtype).reshape(shape)
    if n > MAX_INDEXABLE:
        raise InvalidFormat(f"HPΔKV sparse shape {shape} exceeds the uint32 index range")
    if len(view) < pos + 4:
        raise InvalidFormat("HPΔKV index block is truncated before its count")
    (k,) = struct.unpack_from("<I", view, pos)
    if k > n:
        raise InvalidFormat(f"HPΔKV index block claims {k} indices for {n} elements")
    end = pos + 4 + 4 * k
    if len(view) < end:
        raise InvalidFormat(f"HPΔKV index block of {k} indices is truncated")
    idx = np.frombuffer(view[pos + 4 : end], dtype="<u4").astype(np.int64)
    if k and (idx[-1] >= n or (k > 1 and bool(np.any(np.diff(idx) <= 0)))):
        raise InvalidFormat("HPΔKV indices are out of range or not strictly increasing")
    values = _words_to_tensor(_payload_bytes(view[end:], k, compressed), dtype)
    out = torch.zeros(n, dtype=dtype)
    out[torch.from_numpy(idx)] = values
    return out.reshape(shape)


def estimate_hpdkv_size(
    shape: Sequence[int] | torch.Size | torch.Tensor,
    store_topk: float | None = None,
    compress: bool = False,
) -> int:
    """Blob size in bytes: exact when ``compress`` is False, an upper bound when True.

    The bound uses zlib's ``compressBound`` (stored blocks never exceed it), so callers can
    reserve buffers or decide whether a residual is worth writing without packing it.
    """
    dims = tuple(shape.shape) if isinstance(shape, torch.Tensor) else tuple(shape)
    n = math.prod(int(d) for d in dims)
    size = header_size(len(dims))
    count = n
    if store_topk is not None:
        count = _topk_count(n, store_topk)
        size += 4 + 4 * count
    payload = 2 * count
    if compress:
        payload += (payload >> 12) + (payload >> 14) + (payload >> 25) + 13
    return size + payload
