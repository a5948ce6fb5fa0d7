"""RANS: fast order-0 rANS coders for byte planes (native, with pure-Python fallback decoders).

Why its own coder: exponent planes are skewed without long repeats.  LZ coders lose ratio
there, Huffman loses up to ~2 % on such peaked distributions and zlib's Huffman-only deflate
is slow.  The native coder (``native/rans.c``, built as ``mithril_async._rans``)
codes within ~0.1 % of the order-0 entropy per 256 Ki-symbol block, estimates the coded size
from the histogram first (an incompressible plane costs one histogram pass).  Two layouts:
format v1 (plane method RANS: eight 64-bit states, one stream each; scalar decoder) and format
v2 (method RANS32: 32 interleaved 32-bit states sharing one 16-bit word stream, coded and
decoded with AVX2 where the CPU has it: ~1.6-1.7x v1's speed each way; the scalar paths write and
read the same bytes).  New planes are written as v2; v1 stays readable.
Its calls release the GIL (cffi API mode), so a thread pool scales.

Without the extension :func:`encode` returns ``None`` (callers fall back to deflate) and
:func:`decode` uses a slow but exact Python decoder, so blobs stay readable anywhere.  The
byte layout is in ``docs/FORMAT.md``.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import numpy as np

from mithril_async.errors import CompressionError, InvalidFormat

__all__ = ["NATIVE", "decode", "encode", "format_of", "sample_entropy", "set_level"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]
SCALE = 12
M = 1 << SCALE
RANS_L = 1 << 31
NS = 8
BLOCK_LOG = 18
HDR = 8
V2_LANES = 32
V2_L = 1 << 16

_tls = threading.local()
_ffi: Any = None
_lib: Any = None
NATIVE = False
try:
    _ext: Any = importlib.import_module("mithril_async._rans")
    _ffi, _lib, NATIVE = _ext.ffi, _ext.lib, True
except ImportError:  # pragma: no cover - extension not built
    pass
#: Whether the native coder writes (and natively reads) format v2; an extension built before
#: v2 existed only has v1.
NATIVE_V2 = NATIVE and hasattr(_lib, "mr2_encode")
#: Whether the loaded extension has the sampled-entropy helper (older builds lack it).
_NATIVE_SAMPLE = NATIVE and hasattr(_lib, "mr_sample_entropy")


def set_level(level: int) -> int:
    """Cap the native coders' SIMD level (0 scalar, 1 AVX2, 2 AVX-512 for the v2 encoder;
    -1 the best the CPU has).

    Returns the level in effect; for tests and benchmarks.  Without v2 support: 0.
    """
    return int(_lib.mr_set_level(level)) if NATIVE_V2 else 0


def sample_entropy(plane: U8, max_sample: int) -> float | None:
    """Native order-0 entropy of every ``len // max_sample``-th byte, or ``None`` without it.

    Same sample and formula as :func:`mithril_async.codec.entropy.sample_entropy`.
    """
    if not _NATIVE_SAMPLE:
        return None
    if plane.size == 0:
        return 0.0
    return float(_lib.mr_sample_entropy(_ffi.from_buffer("uint8_t[]", plane), plane.size,
                                        max_sample))


def format_of(data: bytes | memoryview) -> int:
    """The format version (1 or 2) a coded plane declares in its first byte (0 if empty)."""
    return int(data[0]) if len(data) else 0


def encode(plane: U8, limit: int, *, version: int = 2) -> bytes | None:
    """rANS-code ``plane`` if the result is shorter than ``limit`` bytes.

    Returns the coded bytes (format ``version``, or v1 when the loaded extension predates v2:
    see :func:`format_of`), ``b""`` when coding would not get under ``limit`` (store the plane
    raw), or ``None`` when the native coder is unavailable.
    """
    if not NATIVE:
        return None
    n = plane.size
    if n == 0 or n > 0xFFFFFFFF:
        return b""
    v2 = version == 2 and NATIVE_V2  # (NATIVE checked above)
    # v2: a limit below the plane's size (the usual case) needs a smaller buffer
    cap = int(_lib.mr2_encode_cap(n, min(limit, 1 << 62)) if v2 else _lib.mr_encode_bound(n))
    dst: U8 | None = getattr(_tls, "dst", None)
    if dst is None or dst.size < cap:  # per-thread buffer: no page faults per plane
        dst = _tls.dst = np.empty(cap, np.uint8)
    dst = dst[:cap]
    got = int((_lib.mr2_encode if v2 else _lib.mr_encode)(
        _ffi.from_buffer("uint8_t[]", plane), n,
        _ffi.from_buffer("uint8_t[]", dst, require_writable=True), cap, limit))
    if got <= 0:
        return b""
    return dst[:got].tobytes()


def decode(data: bytes | memoryview, out: U8, *, where: str, native: bool = True,
           version: int | None = None) -> None:
    """Decode a RANS plane into ``out`` (exactly ``out.size`` symbols) or ``InvalidFormat``.

    ``version``: the format the plane method promises (1 for RANS, 2 for RANS32); ``None``
    takes the one the plane declares.
    """
    fmt = format_of(data)
    if version is not None and fmt != version:
        raise InvalidFormat(f"{where}: corrupt rANS plane (format {fmt}, expected {version})")
    if fmt == 2:
        if NATIVE and NATIVE_V2 and native:
            rc = int(_lib.mr2_decode(_ffi.from_buffer("uint8_t[]", data), len(data),
                                     _ffi.from_buffer("uint8_t[]", out, require_writable=True),
                                     out.size))
            if rc != 0:
                raise InvalidFormat(f"{where}: corrupt rANS plane (code {rc})")
            return
        _decode_py_v2(bytes(data), out, where)
        return
    if NATIVE and native:
        rc = int(_lib.mr_decode(_ffi.from_buffer("uint8_t[]", data), len(data),
                                _ffi.from_buffer("uint8_t[]", out, require_writable=True),
                                out.size))
        if rc != 0:
            raise InvalidFormat(f"{where}: corrupt rANS plane (code {rc})")
        return
    _decode_py(bytes(data), out, where)


def _read_table(b: bytes, off: int, bad: Any) -> tuple[int, list[int], list[int], list[int]]:
    """One block's frequency table -> (new offset, slot->symbol, freq, start per symbol)."""
    if off + 32 > len(b):
        raise bad("truncated table")
    bitmap = np.unpackbits(np.frombuffer(b, np.uint8, 32, off), bitorder="little")
    syms = np.flatnonzero(bitmap)
    off += 32
    if off + 2 * syms.size > len(b):
        raise bad("truncated table")
    freqs = np.frombuffer(b, "<u2", syms.size, off).astype(np.int64)
    off += 2 * syms.size
    if syms.size == 0 or freqs.min() < 1 or int(freqs.sum()) != M:
        raise bad("frequency table")
    starts = np.concatenate([[0], np.cumsum(freqs)[:-1]])
    fr = np.zeros(256, np.int64)
    st = np.zeros(256, np.int64)
    fr[syms] = freqs
    st[syms] = starts
    return off, np.repeat(syms, freqs).tolist(), fr.tolist(), st.tolist()


def _decode_py_v2(b: bytes, out: U8, where: str) -> None:
    """Reference decoder of format v2 (pure Python): the same checks as ``mr2_decode``."""
    n = out.size

    def bad(why: str) -> InvalidFormat:
        return InvalidFormat(f"{where}: corrupt rANS plane ({why})")

    if len(b) < HDR or b[0] != 2 or b[1] != SCALE or b[2] != BLOCK_LOG or b[3] != V2_LANES:
        raise bad("header")
    if int.from_bytes(b[4:8], "little") != n or n == 0:
        raise bad("symbol count")
    off = HDR
    nb = (n + (1 << BLOCK_LOG) - 1) >> BLOCK_LOG
    for blk in range(nb):
        blen = (1 << BLOCK_LOG) if blk + 1 < nb else n - (blk << BLOCK_LOG)
        off, slot_sym, frl, stl = _read_table(b, off, bad)
        if off + 4 * V2_LANES + 4 > len(b):
            raise bad("truncated stream header")
        state = [int.from_bytes(b[off + 4 * i:off + 4 * i + 4], "little")
                 for i in range(V2_LANES)]
        slen = int.from_bytes(b[off + 4 * V2_LANES:off + 4 * V2_LANES + 4], "little")
        off += 4 * V2_LANES + 4
        if slen > len(b) - off or slen & 1 or any(x < V2_L for x in state):
            raise bad("stream header")
        ptr, end = off, off + slen
        res = bytearray(blen)
        for i in range(blen):
            k = i % V2_LANES
            x = state[k]
            slot = x & (M - 1)
            s = slot_sym[slot]
            x = frl[s] * (x >> SCALE) + slot - stl[s]
            res[i] = s
            if x < V2_L:
                if ptr + 2 > end:
                    raise bad("stream overrun")
                x = (x << 16) | b[ptr] | (b[ptr + 1] << 8)
                ptr += 2
            state[k] = x
        if ptr != end or any(x != V2_L for x in state):
            raise bad("stream end")
        off = end
        out[blk << BLOCK_LOG:(blk << BLOCK_LOG) + blen] = np.frombuffer(bytes(res), np.uint8)
    if off != len(b):
        raise bad("trailing bytes")


def _decode_py(b: bytes, out: U8, where: str) -> None:
    """Reference decoder of format v1 (pure Python, slow: tests): the checks of ``mr_decode``."""
    n = out.size

    def bad(why: str) -> InvalidFormat:
        return InvalidFormat(f"{where}: corrupt rANS plane ({why})")

    if len(b) < HDR or b[0] != 1 or b[1] != SCALE or b[2] != BLOCK_LOG or b[3]:
        raise bad("header")
    if int.from_bytes(b[4:8], "little") != n or n == 0:
        raise bad("symbol count")
    off = HDR
    nb = (n + (1 << BLOCK_LOG) - 1) >> BLOCK_LOG
    for blk in range(nb):
        blen = (1 << BLOCK_LOG) if blk + 1 < nb else n - (blk << BLOCK_LOG)
        off, slot_sym, frl, stl = _read_table(b, off, bad)
        if off + 12 * NS > len(b):
            raise bad("truncated stream header")
        state = [int.from_bytes(b[off + 8 * i:off + 8 * i + 8], "little") for i in range(NS)]
        lens = [int.from_bytes(b[off + 8 * NS + 4 * i:off + 8 * NS + 4 * i + 4], "little")
                for i in range(NS)]
        off += 12 * NS
        if (sum(lens) > len(b) - off or any(ln & 3 for ln in lens)
                or any(not RANS_L <= x < RANS_L << 32 for x in state)):
            raise bad("stream header")
        ptr, ends = [], []
        for ln in lens:
            ptr.append(off)
            off += ln
            ends.append(off)
        res = bytearray(blen)
        for i in range(blen):
            k = i % NS
            x = state[k]
            slot = x & (M - 1)
            s = slot_sym[slot]
            x = frl[s] * (x >> SCALE) + slot - stl[s]
            res[i] = s
            if x < RANS_L:
                p = ptr[k]
                if p + 4 > ends[k]:
                    raise bad("stream overrun")
                x = (x << 32) | int.from_bytes(b[p:p + 4], "little")
                ptr[k] = p + 4
            state[k] = x
        if ptr != ends or any(x != RANS_L for x in state):
            raise bad("stream end")
        out[blk << BLOCK_LOG:(blk << BLOCK_LOG) + blen] = np.frombuffer(bytes(res), np.uint8)
    if off != len(b):
        raise bad("trailing bytes")


# ---------------------------------------------------------------------------------------------
# every plane of a chunk in one native call (native/chunkenc.c)

#: ``methods`` value of a plane :func:`encode_planes` left to the caller (it wants a zstd try)
PLANE_PYTHON = 255
_HAS_PLANES = NATIVE_V2 and hasattr(_lib, "mc_encode_planes")
_env_ok = False


def bind_coders(xxh3: int, zinit: int, zdeflate: int, zreset: int, zend: int,
                zversion: bytes) -> bool:
    """Hand the native chunk coder the addresses of XXH3_64bits and zlib-ng's deflate entry
    points (resolved by :mod:`~mithril_async.codec.entropy` from the very modules the Python
    path calls, so both paths write the same bytes).  Whether :func:`encode_planes` may run."""
    global _env_ok
    if not _HAS_PLANES:
        return False
    _env_ok = int(_lib.mc_set_env(xxh3, zinit, zdeflate, zreset, zend, zversion)) == 0
    return _env_ok


def bind_zstd(create: int, free: int, setp: int, compress2: int, iserr: int) -> bool:
    """Hand the native chunk coder zstd's entry points (of the zstd python-zstandard uses):
    it then tries zstd on low-entropy planes itself instead of leaving them to Python."""
    return _HAS_PLANES and int(_lib.mc_set_zstd(create, free, setp, compress2, iserr)) == 0


def planes_available() -> bool:
    """Whether :func:`encode_planes` runs (extension built with it, coders bound, and the
    native rANS coder not switched off, e.g. by a test)."""
    return _env_ok and NATIVE and NATIVE_V2


def encode_planes(raw: U8, planes: U8, sizes: list[int], *, raw_bits: float,
                  huff_min_bits: float, min_gain: float, level: int
                  ) -> tuple[U8, list[int], list[int], int, int]:
    """Code the consecutive ``planes`` of one chunk (``sizes`` bytes each) in one native call
    with the GIL released, as ``entropy.encode_plane(mode="float")`` would one by one.

    ``planes`` is a scratch buffer: the stored planes are compacted into it in place.
    Returns ``(stored, methods, lengths, raw_hash, payload_hash)``: the stored planes back to
    back (an exactly sized copy), each plane's method and stored length (``PLANE_PYTHON``: not
    coded, the plane itself in its place in ``stored``, for the caller to code; then
    ``payload_hash`` is 0) and the XXH3-64 of ``raw`` and of ``stored``.
    """
    k = len(sizes)
    sz = np.asarray(sizes, np.uint64)
    psz = _ffi.cast("uint64_t *", sz.ctypes.data)
    arena = _arena(int(_lib.mc_arena_cap(psz, k)))
    meta = np.zeros(k * 9 + 16, np.uint8)  # lens (u64 x k), hashes (u64 x 2), methods (u8 x k)
    lens = meta[:8 * k].view(np.uint64)
    hashes = meta[8 * k:8 * k + 16].view(np.uint64)
    methods = meta[8 * k + 16:]
    pp = _ffi.from_buffer("uint8_t[]", planes, require_writable=True)
    got = int(_lib.mc_encode_planes(
        _ffi.from_buffer("uint8_t[]", raw), raw.size, pp, psz, k, raw_bits, huff_min_bits,
        min_gain, level, _ffi.from_buffer("uint8_t[]", arena, require_writable=True),
        arena.size, pp, _ffi.cast("uint8_t *", methods.ctypes.data),
        _ffi.cast("uint64_t *", lens.ctypes.data), _ffi.cast("uint64_t *", hashes.ctypes.data)))
    if got < 0:
        raise CompressionError(f"native chunk coder failed (code {got})")
    # an exactly sized copy (numpy copies without the GIL): the scratch is reused
    return (planes[:got].copy(), methods.tolist(), lens.tolist(), int(hashes[0]),
            int(hashes[1]))


def _arena(cap: int) -> U8:
    """The calling thread's coder workspace of at least ``cap`` bytes (reused: no page faults
    per chunk)."""
    arena: U8 | None = getattr(_tls, "arena", None)
    if arena is None or arena.size < cap:
        arena = _tls.arena = np.empty(max(cap, 1 << 16), np.uint8)
    return arena


def encode_batch(raws: list[U8], planes: U8, sizes: list[list[int]], *, raw_bits: float,
                 huff_min_bits: float, min_gain: float, level: int
                 ) -> tuple[U8, list[tuple[list[int], list[int], int, int, int, int]]]:
    """:func:`encode_planes` for many chunks in one native call (a batch of small chunks: the
    call's fixed cost and the GIL round trip are paid once).  ``planes``: every chunk's planes
    back to back, chunk ``c`` having ``sizes[c]`` (a scratch buffer, compacted in place).
    Returns the stored bytes of all chunks back to back and per chunk ``(methods, lengths,
    raw_hash, payload_hash, offset, size)`` (its stored bytes are
    ``stored[offset:offset + size]``)."""
    nc = len(raws)
    counts = np.asarray([len(s) for s in sizes], np.int32)
    flat = np.asarray([n for s in sizes for n in s], np.uint64)
    k = flat.size
    psz = _ffi.cast("uint64_t *", flat.ctypes.data)
    pcounts = _ffi.cast("int32_t *", counts.ctypes.data)
    arena = _arena(int(_lib.mc_batch_cap(psz, pcounts, nc)))
    ptrs = np.asarray([r.ctypes.data for r in raws], np.uint64)
    rsz = np.asarray([r.size for r in raws], np.uint64)
    words = np.zeros(k + 3 * nc, np.uint64)  # lens (k), hashes (2 per chunk), stored (nc)
    methods = np.zeros(k, np.uint8)
    got = int(_lib.mc_encode_batch(
        nc, _ffi.cast("uintptr_t *", ptrs.ctypes.data), _ffi.cast("uint64_t *", rsz.ctypes.data),
        _ffi.from_buffer("uint8_t[]", planes, require_writable=True), psz, pcounts, raw_bits,
        huff_min_bits, min_gain, level,
        _ffi.from_buffer("uint8_t[]", arena, require_writable=True), arena.size,
        _ffi.cast("uint8_t *", methods.ctypes.data), _ffi.cast("uint64_t *", words.ctypes.data),
        _ffi.cast("uint64_t *", words[k:].ctypes.data),
        _ffi.cast("uint64_t *", words[k + 2 * nc:].ctypes.data)))
    if got < 0:
        raise CompressionError(f"native chunk coder failed (code {got})")
    stored = planes[:got].copy()
    mlist, wl = methods.tolist(), words.tolist()
    res = []
    p = off = 0
    for c in range(nc):
        n = int(counts[c])
        size = wl[k + 2 * nc + c]
        res.append((mlist[p:p + n], wl[p:p + n], wl[k + 2 * c], wl[k + 2 * c + 1], off, size))
        p += n
        off += size
    return stored, res


# ---------------------------------------------------------------------------------------------
# one chunk decoded in one native call (native/chunkenc.c: mc_decode_chunk)

#: mc_decode_chunk's results (native/chunkenc.h: MC_DEC_*)
DEC_OK, DEC_ARGS, DEC_PAYLOAD, DEC_BAD_PLANE, DEC_RANS, DEC_METHOD, DEC_RAW = 0, -1, -2, -3, -4, \
    -5, -6
_HAS_DECODER = NATIVE_V2 and hasattr(_lib, "mc_decode_chunk")
_decoder_ok = False


def bind_decoder(xxh3: int, ungroup_planes: int) -> bool:
    """Hand the native chunk decoder XXH3_64bits (of python-xxhash, as the encoder) and
    ``mk_ungroup_planes`` (of ``mithril_async._kernels``) by address; whether
    :func:`decode_chunk_native` may run."""
    global _decoder_ok
    _decoder_ok = _HAS_DECODER and int(_lib.mc_set_decoder(xxh3, ungroup_planes)) == 0
    return _decoder_ok


def decoder_available() -> bool:
    """Whether :func:`decode_chunk_native` runs (built, bound, the native rANS coder not
    switched off, e.g. by a test that wants the Python decoders)."""
    return _decoder_ok and NATIVE and NATIVE_V2


def decode_chunk_native(payload: memoryview, methods: bytes, lens: list[int], width: int,
                        kind: int, base: U8 | None, scratch: U8, out: U8, want_payload: int,
                        want_raw: int, check_payload: bool) -> tuple[int, int, int]:
    """One chunk decoded by ``mc_decode_chunk`` with the GIL released (see
    native/chunkenc.h): ``(code, plane, value)``: code :data:`DEC_OK` or another ``DEC_*``,
    the plane it concerns (-1 for none), and the hash it got (payload / raw mismatch) or the
    rANS decoder's code."""
    words = _ffi.new("uint64_t[4]", [want_payload, want_raw, 0, 0])
    bad = _ffi.new("int *")
    rc = int(_lib.mc_decode_chunk(
        _ffi.from_buffer("uint8_t[]", payload), len(payload), methods,
        _ffi.new("uint64_t[]", lens), len(lens), width, kind,
        _ffi.NULL if base is None else _ffi.from_buffer("uint8_t[]", base),
        _ffi.from_buffer("uint8_t[]", scratch, require_writable=True), scratch.size,
        _ffi.from_buffer("uint8_t[]", out, require_writable=True), out.size, words,
        int(check_payload), words + 2, bad))
    value = int(words[3]) if rc == DEC_RAW else int(words[2])
    if rc == DEC_RANS:
        value = int(_ffi.cast("int64_t", words[2]))
    return rc, int(bad[0]), value
