"""Entropy coding of one byte plane: raw, constant, rANS, zstd or Huffman-only deflate.

Why several coders: after byte grouping a float tensor splits into planes of very different
nature.  Exponent planes are skewed but have no long repeats, so LZ matching (zstd) *hurts*
(short matches cost more than they save: on all-MiniLM-L6-v2 bf16 exponents zstd-3 spends 3.3
bits/byte against an order-0 entropy of 2.66); an order-0 coder reaches the entropy bound.
The native rANS coder (:mod:`.rans`; planes are written as RANS32, its SIMD-decodable
layout, and the older RANS layout stays readable) does that fast and within ~0.1 % of the
bound, and knows the coded size from the histogram before coding, so near-random mantissa
planes are stored raw after one histogram pass.  Delta (XOR) planes are mostly zeros with
runs, where zstd's matches win by orders of magnitude (both are tried when the sampled
entropy is low).  Constant planes (the all-zero low mantissa bytes of an fp32 copy of bf16
weights) take one byte.  Huffman-only deflate (zlib's ``Z_HUFFMAN_ONLY``, a
standard stream any inflater reads) is the fallback when the native coder is not built.

Every coder here is synchronous, thread-safe (per-thread contexts) and spends its time in C
with the GIL released, so a thread pool scales.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import numpy as np
import zstandard

from mithril_async.codec import rans
from mithril_async.errors import CompressionError, InvalidFormat

__all__ = ["HUFF_BACKENDS", "MIN_GAIN", "NATIVE_PLANES", "PlaneMethod", "decode_plane",
           "encode_plane", "sample_entropy"]

# Huffman-only deflate is a standard format, so the fastest available implementation can be
# used on each side: zlib-ng to encode, libdeflate to decode (both faster than zlib; numbers
# in docs/BENCHMARKS.md); stdlib zlib is the always-present fallback (and the format
# guarantee).
_zlib_enc: Any = zlib
with contextlib.suppress(ImportError):  # optional accelerator
    from zlib_ng import zlib_ng as _zlib_enc
_inflate_exact: Callable[[bytes | memoryview, int], Any] | None = None
_libdeflate: Any
try:
    import deflate as _libdeflate

    def _inflate_exact(data: bytes | memoryview, n: int) -> Any:
        return _libdeflate.deflate_decompress(data, n)
except ImportError:  # pragma: no cover - optional accelerator
    _libdeflate = None

#: Which implementations code HUFF planes here (for benchmark tables).
HUFF_BACKENDS = {
    "encode": "zlib-ng" if _zlib_enc is not zlib else "zlib",
    "decode": "libdeflate" if _inflate_exact is not None else "zlib",
}


def _bind_native_coders() -> bool:
    """Give the native chunk coder (``rans.encode_planes``) the XXH3 and Huffman-only deflate
    of the modules this file uses (python-xxhash, python-zlib-ng), by address, so the one-call
    path writes the very bytes the per-plane path writes.  False (the per-plane path stays)
    when the deflate in use is not zlib-ng's or a symbol is missing."""
    if _zlib_enc is zlib or not rans.NATIVE_V2:
        return False
    try:
        import ctypes

        import xxhash._xxhash as xx
        import zlib_ng.zlib_ng as zng

        xl, zl = ctypes.CDLL(xx.__file__), ctypes.CDLL(zng.__file__)

        def addr(lib: Any, name: str) -> int:
            return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)

        version = zl.zlibng_version
        version.restype = ctypes.c_char_p
        bound = rans.bind_coders(addr(xl, "XXH3_64bits"), addr(zl, "zng_deflateInit2_"),
                                 addr(zl, "zng_deflate"), addr(zl, "zng_deflateReset"),
                                 addr(zl, "zng_deflateEnd"), version())
    except (ImportError, OSError, AttributeError):  # pragma: no cover - unusual installs
        return False
    if bound:
        _bind_zstd()
    return bound


def _bind_zstd() -> bool:
    """zstd for the native chunk coder: the cffi backend of python-zstandard exports the zstd
    it bundles; used only when it is the very release the C backend (what ``_zc`` codes
    with) reports, so the bytes match.  Without it, low-entropy planes come back to Python."""
    try:
        import zstandard._cffi as zc
    except ImportError:  # pragma: no cover - wheel without the cffi backend
        return False
    major, minor, patch = zstandard.ZSTD_VERSION
    if (zstandard.backend != "cext"
            or int(zc.lib.ZSTD_versionNumber()) != major * 10000 + minor * 100 + patch):
        return False  # pragma: no cover - mismatched builds

    def addr(name: str) -> int:
        return int(zc.ffi.cast("uintptr_t", zc.ffi.addressof(zc.lib, name)))

    return rans.bind_zstd(addr("ZSTD_createCCtx"), addr("ZSTD_freeCCtx"),
                          addr("ZSTD_CCtx_setParameter"), addr("ZSTD_compress2"),
                          addr("ZSTD_isError"))


#: Whether whole chunks can be coded in one native call (``rans.encode_planes``, ``encode_batch``).
NATIVE_PLANES = _bind_native_coders()
_CODER_ERRORS: tuple[type[Exception], ...] = (zstandard.ZstdError, zlib.error) + (
    (_libdeflate.DeflateError,) if _libdeflate is not None else ())

U8 = np.ndarray[Any, np.dtype[np.uint8]]


class PlaneMethod(IntEnum):
    """How a plane is stored; the value is written into block headers (never renumber)."""

    RAW = 0
    ZSTD = 1
    HUFF = 2  # raw deflate stream, Z_HUFFMAN_ONLY, no zlib header
    CONST = 3  # one byte, repeated raw_len times
    RANS = 4  # order-0 rANS format v1 (8 x 64-bit states), see mithril_async/codec/rans.py
    RANS32 = 5  # order-0 rANS format v2 (32 x 32-bit states, one stream; SIMD decoder)


_SMALL_PLANE = 16384  # (native/chunkenc.c: SMALL_PLANE)
#: a coded plane must save this fraction of its size or it is stored raw
MIN_GAIN = 0.01
_SAMPLE = 16384  # (native/chunkenc.c: SAMPLE)
_LOG2 = np.log2(np.arange(1, 1 << 17, dtype=np.float64))
_tls = threading.local()


def sample_entropy(plane: U8) -> float:
    """Order-0 entropy (bits/byte) of an evenly strided sample of at most 16 Ki bytes.

    Only a cheap hint (is this plane skewed enough that zstd might win?); the coders decide on
    exact sizes.
    """
    native = rans.sample_entropy(plane, _SAMPLE) if plane.flags.c_contiguous else None
    if native is not None:
        return native
    return sample_entropy_py(plane)


def sample_entropy_py(plane: U8) -> float:
    """numpy reference of :func:`sample_entropy` (and the path without the extension)."""
    n = plane.size
    sample = plane if n <= _SAMPLE else plane[:: n // _SAMPLE]
    m = sample.size
    if m == 0:
        return 0.0
    counts = np.bincount(sample, minlength=256)
    counts = counts[counts > 0]
    # H = log2(m) - sum(c*log2 c)/m, with a log table for speed (m <= 32 Ki here).
    return float(_LOG2[m - 1] - (counts * _LOG2[counts - 1]).sum() / m)


def _zc(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_tls, "zc", None)
    if cache is None:
        cache = _tls.zc = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
    return c


def _zd() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


def _huff(plane: U8) -> bytes:
    z = _zlib_enc
    c = z.compressobj(1, z.DEFLATED, -15, 9, z.Z_HUFFMAN_ONLY)
    return bytes(c.compress(plane) + c.flush())


def encode_plane(plane: U8, *, level: int, mode: str, raw_bits: float,
                 huff_min_bits: float, min_gain: float = MIN_GAIN
                 ) -> tuple[PlaneMethod, bytes | U8]:
    """Code one plane; returns the method and its stored bytes (never longer than the plane).

    ``mode``: ``"float"`` (planes of float dtypes: skew, no repeats) codes with rANS, and also
    tries zstd when the sampled entropy is below ``huff_min_bits`` (runs, e.g. XOR deltas),
    keeping the smaller; a coded plane must save ``min_gain`` of its size or it is stored raw.
    Without the native rANS coder it falls back to Huffman-only deflate, using the sampled
    entropy (``raw_bits``) to skip near-random planes.  ``"zstd"`` always uses zstd
    (integers, bools: LZ structure); ``"raw"`` stores as is.
    """
    n = plane.size
    if n == 0 or mode == "raw":
        return PlaneMethod.RAW, plane
    if n > 1 and plane[0] == plane[-1] and plane[0] == plane[n // 2]:
        v = plane[0]
        if not np.any(plane != v):
            return PlaneMethod.CONST, bytes((int(v),))
    limit = n - int(n * min_gain) if mode == "float" else n
    best: tuple[PlaneMethod, bytes | U8] = (PlaneMethod.RAW, plane)
    try:
        if mode == "float":
            h = sample_entropy(plane)
            if h < huff_min_bits:
                z = _zc(level).compress(plane.data)
                if len(z) < limit:
                    best, limit = (PlaneMethod.ZSTD, z), len(z)
            # A sample at >= raw_bits bits/byte cannot save min_gain (the sample's estimate
            # runs low, not high): store raw without the coder's histogram pass.
            r = rans.encode(plane, limit) if h < raw_bits else (b"" if rans.NATIVE else None)
            if r:
                m = PlaneMethod.RANS32 if rans.format_of(r) == 2 else PlaneMethod.RANS
                best, limit = (m, r), len(r)
            # Without the native coder, or for small planes where rANS's ~100-byte tables
            # dominate: Huffman-only deflate (cheap at this size).
            if (r is None and best[0] == PlaneMethod.RAW and h < raw_bits) or (
                    n <= _SMALL_PLANE and r is not None):
                out = _huff(plane)
                if len(out) < limit:
                    best = (PlaneMethod.HUFF, out)
        else:
            out = _zc(level).compress(plane.data)
            if len(out) < limit:
                best = (PlaneMethod.ZSTD, out)
    except _CODER_ERRORS as e:  # pragma: no cover - coder bug
        raise CompressionError(f"coding a {n}-byte plane failed: {e}") from e
    return best


def decode_plane(method: int, data: memoryview, out: U8, *, where: str) -> None:
    """Decode one stored plane into ``out`` (exactly ``out.size`` bytes or ``InvalidFormat``)."""
    n = out.size
    try:
        if method == PlaneMethod.RAW:
            if len(data) != n:
                raise InvalidFormat(f"{where}: raw plane holds {len(data)} bytes, expected {n}")
            out[:] = np.frombuffer(data, np.uint8)
        elif method == PlaneMethod.CONST:
            if len(data) != 1:
                raise InvalidFormat(f"{where}: constant plane of {len(data)} bytes")
            out.fill(data[0])
        elif method == PlaneMethod.ZSTD:
            size = zstandard.frame_content_size(data)
            if size != n:
                raise InvalidFormat(f"{where}: zstd frame declares {size} bytes, expected {n}")
            dec = _zd().decompress(data, max_output_size=n)
            if len(dec) != n:
                raise InvalidFormat(f"{where}: zstd plane decoded to {len(dec)} bytes, not {n}")
            out[:] = np.frombuffer(dec, np.uint8)
        elif method == PlaneMethod.RANS:
            rans.decode(data, out, where=where, version=1)
        elif method == PlaneMethod.RANS32:
            rans.decode(data, out, where=where, version=2)
        elif method == PlaneMethod.HUFF:
            if _inflate_exact is not None:
                dec = _inflate_exact(data, n)
            else:
                d = zlib.decompressobj(-15)
                dec = d.decompress(data, n)
                if d.unconsumed_tail or d.unused_data or not d.eof:
                    dec = b""
            if len(dec) != n:
                raise InvalidFormat(f"{where}: huffman plane does not decode to {n} bytes")
            out[:] = np.frombuffer(dec, np.uint8)
        else:
            raise InvalidFormat(f"{where}: unknown plane method {method}")
    except _CODER_ERRORS as e:
        raise InvalidFormat(f"{where}: corrupt compressed plane: {e}") from e
