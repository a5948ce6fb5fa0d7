"""Encode/decode one chunk of one tensor: optional XOR delta, byte transform, plane coding.

A chunk is a contiguous, element-aligned byte range of a tensor (a few MiB, so big tensors
spread over the thread pool).  Encoding is::

    raw bytes --(XOR base)--> --(transform)--> planes --(per-plane coder)--> payload

The transforms (none, byte grouping, exponent planes) live in
:mod:`~mithril_async.codec.transforms`, one small object per on-disk id; this module dispatches
on that registry for every choice, layout, inverse and validation (``docs/CODEC.md``).

Both directions are synchronous, thread-safe and spend their time in C (the byte kernels,
zlib/zstd, xxhash), so the manager can run many chunks on a thread pool.  The chunk carries a
64-bit hash of its raw bytes (verified after decoding: wrong data is never returned) and of its
stored payload (verified before decoding: corruption is reported before any decoder runs):
XXH3-64 since MCKP version 2 (XXH64 in version 1; see :func:`chunk_hasher`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from mithril_async.codec import kernels, rans
from mithril_async.codec.dtypes import dtype_info
from mithril_async.codec.entropy import MIN_GAIN, PlaneMethod, decode_plane, encode_plane
from mithril_async.codec.params import CodecParams
from mithril_async.codec.transforms import CHOICE_ORDER, REGISTRY, ChunkTransform, Transform
from mithril_async.errors import ChecksumMismatch, InvalidFormat, ShapeMismatch

__all__ = [
    "BATCH_CHUNK_BYTES",
    "CHUNK_HASH_VERSION",
    "DELTA_BIT",
    "CodecParams",
    "ChunkMeta",
    "EncodedChunk",
    "Transform",
    "choose_transform",
    "chunk_hasher",
    "chunk_spans",
    "decode_chunk",
    "encode_chunk",
    "encode_chunks",
    "plane_sizes",
    "transform_bytes",
    "transform_for",
]

U8 = np.ndarray[Any, np.dtype[np.uint8]]

#: Set in ``ChunkMeta.transform`` when the chunk was XORed with a base before the transform.
DELTA_BIT = 0x80

#: The MCKP format version whose chunk hashes :func:`encode_chunk` writes.
CHUNK_HASH_VERSION = 2
# Chunk (raw and payload) hashes by MCKP format version.  Version 2 moved from XXH64 to
# XXH3-64: XXH64 is latency-bound (one dependent chain per 32 bytes) and was a large share of
# a bf16 chunk's coding time; XXH3 is vectorised.  Same 8-byte fields, seed 0.
_HASHERS: dict[int, tuple[Callable[[Any], int], Callable[[], Any]]] = {
    1: (xxhash.xxh64_intdigest, xxhash.xxh64),
    2: (xxhash.xxh3_64_intdigest, xxhash.xxh3_64),
}


def chunk_hasher(version: int) -> Callable[[Any], int]:
    """The function (buffer -> int) that hashes chunk bytes in MCKP format ``version``."""
    try:
        return _HASHERS[version][0]
    except KeyError:
        raise InvalidFormat(f"no chunk hash is defined for MCKP version {version}") from None


def transform_for(transform: int, where: str = "chunk") -> ChunkTransform:
    """The registered transform of a block header's transform byte (delta bit ignored);
    :class:`InvalidFormat` naming ``where`` for any other value."""
    tr = None if transform & ~(DELTA_BIT | 0x7F) else REGISTRY.get(transform & ~DELTA_BIT)
    if tr is None:
        raise InvalidFormat(f"{where}: unknown transform {transform}")
    return tr


@dataclass(frozen=True)
class ChunkMeta:
    """Everything a block header records about an encoded chunk."""

    transform: int  # Transform value | DELTA_BIT
    width: int  # group width (1 for NONE)
    raw_size: int
    raw_xxh64: int  # hash of the raw bytes (the function of hash_version)
    payload_xxh64: int  # hash of the stored payload (ditto)
    planes: tuple[tuple[int, int], ...]  # (PlaneMethod, stored length) per plane
    hash_version: int = CHUNK_HASH_VERSION  # MCKP version whose chunk hashes these are

    @property
    def stored_size(self) -> int:
        return sum(s for _, s in self.planes)

    @property
    def is_delta(self) -> bool:
        return bool(self.transform & DELTA_BIT)


@dataclass(frozen=True)
class EncodedChunk:
    """An encoded chunk: its metadata and stored planes (``parts``, in plane order).

    The planes stay separate buffers (raw planes are views of the transform's output) so the
    container writes them out with a single copy; ``payload`` concatenates them.  ``span``:
    the same bytes as one buffer, when the planes lie back to back in one (the native coder's
    output), so writing and hashing a block takes one call for its payload, not one per plane.
    """

    meta: ChunkMeta
    parts: tuple[Any, ...]
    span: Any = field(default=None, compare=False, repr=False)
    #: (NaNs, Infs) among the chunk's own values (never their XOR with a base), counted in
    #: the transform's pass over them; (0, 0) for a dtype without NaN or Inf
    nonfinite: tuple[int, int] = field(default=(0, 0), compare=False)

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


_tls = threading.local()


def _scratch(name: str, n: int) -> U8:
    """A per-thread reusable buffer of ``n`` bytes.

    Fresh multi-MiB allocations cost page faults on first touch (about a memcpy's worth per
    chunk); reusing one buffer per worker thread avoids that.
    """
    buf: U8 | None = getattr(_tls, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1 << 20), np.uint8)
        setattr(_tls, name, buf)
    return buf[:n]


def chunk_spans(nbytes: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[(offset, length), ...]`` covering ``nbytes``, each a multiple of ``itemsize`` long.

    An empty tensor has no chunks.  The chunk size is rounded down to a whole number of
    elements (at least one element).
    """
    if nbytes < 0 or itemsize < 1 or nbytes % itemsize:
        raise ValueError(f"chunk_spans: {nbytes} bytes is not a whole number of {itemsize}-byte "
                         "elements")
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]


def plane_sizes(transform: int, width: int, raw_size: int) -> list[int]:
    """Raw sizes of the planes a transform splits ``raw_size`` bytes into (tail plane last)."""
    w = transform_for(transform).planes(width)
    n = raw_size // w
    sizes = [n] * w
    if raw_size - n * w:
        sizes.append(raw_size - n * w)
    return sizes


def choose_transform(dtype_name: str, size: int, params: CodecParams
                     ) -> tuple[Transform, int, str]:
    """The byte transform, its width and the plane coding mode (``"float"``/``"zstd"``) that
    :func:`encode_chunk` uses for ``size`` bytes of ``dtype_name``."""
    info = dtype_info(dtype_name)
    mode = "zstd" if params.entropy == "zstd" or info.kind not in ("float", "complex") else "float"
    for tr in CHOICE_ORDER:
        width = tr.choose(info, size, params)
        if width is not None:
            return tr.id, width, mode
    raise AssertionError("the NONE transform takes every chunk")  # pragma: no cover


def _check_transform(meta: ChunkMeta, where: str) -> ChunkTransform:
    tr = transform_for(meta.transform, where)
    if meta.width not in tr.widths:
        raise InvalidFormat(f"{where}: width {meta.width} invalid for {tr.name}")
    return tr


def transform_bytes(src: U8, transform: Transform, width: int, base: U8 | None,
                    out: U8 | None = None, tally: kernels.NonFiniteTally | None = None) -> U8:
    """The planes ``transform`` makes of ``src`` (XORed with ``base`` first when given), in
    ``out`` when given; ``NONE`` without a base returns ``src`` itself (and counts nothing
    into ``tally``, the NaN/Inf elements of ``src`` the other transforms count)."""
    return transform_for(transform).forward(src, width, base, out, tally)


def _counts(tally: kernels.NonFiniteTally | None) -> tuple[int, int]:
    return (0, 0) if tally is None else (tally.nan, tally.inf)


def encode_chunk(src: U8, dtype_name: str, base: U8 | None, params: CodecParams) -> EncodedChunk:
    """Encode the raw bytes ``src`` of one chunk (``base``: same-size bytes to XOR with).

    Float chunks are coded by one native call for all their planes and both hashes, with the
    GIL released (``rans.encode_planes``; a plane that asks for a zstd try comes back to
    :func:`~mithril_async.codec.entropy.encode_plane`), so codec threads scale; other chunks,
    and every chunk without that native coder, go plane by plane.  Both write the same bytes.
    The NaN/Inf elements of ``src`` are counted in the transform's (or copy's) pass over it
    (``EncodedChunk.nonfinite``).
    """
    raw_size = src.size
    if base is not None and base.size != raw_size:
        raise ShapeMismatch(f"delta base has {base.size} bytes, chunk has {raw_size}")
    transform, width, mode = choose_transform(dtype_name, raw_size, params)
    tally = kernels.NonFiniteTally.of(dtype_name)
    buf = transform_bytes(src, transform, width, base, out=_scratch("enc", raw_size),
                          tally=tally)
    sizes = plane_sizes(transform, width, raw_size)
    tbyte = int(transform) | (DELTA_BIT if base is not None else 0)
    if mode == "float" and rans.planes_available():
        if buf is src:  # NONE without a base: the native coder compacts its planes in place
            buf = kernels.copy(src, _scratch("enc", raw_size), tally=tally)
        return _encode_native(src, buf, sizes, tbyte, width, params, _counts(tally))
    if buf is src and tally is not None:  # nothing read src yet: a pass of its own
        kernels.count_nonfinite(src, tally)
    digest, stream = _HASHERS[CHUNK_HASH_VERSION]
    raw_xxh = digest(src.data)
    parts: list[Any] = []
    planes: list[tuple[int, int]] = []
    off = 0
    for n in sizes:
        method, data = encode_plane(buf[off:off + n], level=params.level, mode=mode,
                                    raw_bits=params.raw_bits,
                                    huff_min_bits=params.huff_min_bits)
        if isinstance(data, np.ndarray) and buf is not src:
            data = data.tobytes()  # a raw view of the scratch buffer: copy it out
        parts.append(data)
        planes.append((int(method), len(data)))
        off += n
    h = stream()
    for part in parts:
        h.update(part)
    meta = ChunkMeta(tbyte, width, raw_size, raw_xxh, h.intdigest(), tuple(planes),
                     CHUNK_HASH_VERSION)
    return EncodedChunk(meta, tuple(parts), nonfinite=_counts(tally))


#: chunks up to this size are coded together by :func:`encode_chunks`, one native call per
#: batch (their per-call costs, not their bytes, dominate their coding time)
BATCH_CHUNK_BYTES = 64 << 10


def encode_chunks(items: Sequence[tuple[U8, str, U8 | None]], params: CodecParams
                  ) -> list[EncodedChunk]:
    """:func:`encode_chunk` of every ``(src, dtype_name, base)``, in order; the float chunks
    in one native call with the GIL released (meant for batches of small chunks, each of
    which would otherwise pay a pool task, a native call and their Python; the bytes are the
    same)."""
    out: list[EncodedChunk | None] = [None] * len(items)
    batch: list[tuple[int, int, int, list[int]]] = []  # index, transform byte, width, sizes
    tallies: list[kernels.NonFiniteTally | None] = []  # per batched chunk
    total = 0
    native = rans.planes_available()
    for i, (src, dtype_name, base) in enumerate(items):
        if base is not None and base.size != src.size:
            raise ShapeMismatch(f"delta base has {base.size} bytes, chunk has {src.size}")
        transform, width, mode = choose_transform(dtype_name, src.size, params)
        if mode != "float" or not native or not src.size:
            out[i] = encode_chunk(src, dtype_name, base, params)
            continue
        tbyte = int(transform) | (DELTA_BIT if base is not None else 0)
        batch.append((i, tbyte, width, plane_sizes(transform, width, src.size)))
        total += src.size
    if batch:  # the transform scratch: no encode_chunk above still uses it
        planes = _scratch("enc", total)
        raws: list[U8] = []
        off = 0
        for i, tbyte, width, _ in batch:
            src, dtype_name, base = items[i]
            dst = planes[off:off + src.size]
            tally = kernels.NonFiniteTally.of(dtype_name)
            got = transform_bytes(src, Transform(tbyte & ~DELTA_BIT), width, base, out=dst,
                                  tally=tally)
            if got is src:  # NONE without a base hands back its input
                kernels.copy(src, dst, tally=tally)
            tallies.append(tally)
            raws.append(src)
            off += src.size
        stored, results = rans.encode_batch(
            raws, planes, [b[3] for b in batch], raw_bits=params.raw_bits,
            huff_min_bits=params.huff_min_bits, min_gain=MIN_GAIN, level=params.level)
        view = memoryview(stored)  # type: ignore[arg-type]
        for (i, tbyte, width, sizes), (methods, lens, raw_xxh, pxxh, soff, _), tally in zip(
                batch, results, tallies, strict=True):
            out[i] = _assemble(view, soff, sizes, methods, lens, tbyte, width, raw_xxh, pxxh,
                               params, _counts(tally))
    return [e for e in out if e is not None]


def _assemble(stored: memoryview, off: int, sizes: list[int], methods: list[int],
              lens: list[int], tbyte: int, width: int, raw_xxh: int, payload_xxh: int,
              params: CodecParams, nonfinite: tuple[int, int]) -> EncodedChunk:
    """An :class:`EncodedChunk` from what the native coder returned for one chunk (its stored
    planes from ``stored[off:]``), coding any plane it left over (kept there as is)."""
    parts: list[Any] = []
    meta_planes: list[tuple[int, int]] = []
    left_over = False
    start = off
    for method, ln in zip(methods, lens, strict=True):
        data: Any = stored[off:off + ln]
        off += ln
        if method == rans.PLANE_PYTHON:  # its zstd try: the per-plane coder
            plane = np.frombuffer(data, np.uint8)
            method, data = encode_plane(plane, level=params.level, mode="float",
                                        raw_bits=params.raw_bits,
                                        huff_min_bits=params.huff_min_bits)
            if isinstance(data, np.ndarray):
                data = data.tobytes()
            left_over = True
        parts.append(data)
        meta_planes.append((int(method), len(data)))
    if left_over:
        h = _HASHERS[CHUNK_HASH_VERSION][1]()
        for part in parts:
            h.update(part)
        payload_xxh = h.intdigest()
    meta = ChunkMeta(tbyte, width, sum(sizes), raw_xxh, payload_xxh, tuple(meta_planes),
                     CHUNK_HASH_VERSION)
    return EncodedChunk(meta, tuple(parts), None if left_over else stored[start:off],
                        nonfinite)


def _encode_native(src: U8, buf: U8, sizes: list[int], tbyte: int, width: int,
                   params: CodecParams, nonfinite: tuple[int, int]) -> EncodedChunk:
    """:func:`encode_chunk` of a float chunk: its planes ``buf`` coded in one native call."""
    stored, methods, lens, raw_xxh, payload_xxh = rans.encode_planes(
        src, buf, sizes, raw_bits=params.raw_bits, huff_min_bits=params.huff_min_bits,
        min_gain=MIN_GAIN, level=params.level)
    return _assemble(memoryview(stored), 0, sizes,  # type: ignore[arg-type]
                     methods, lens, tbyte, width, raw_xxh, payload_xxh, params, nonfinite)


#: plane methods the native chunk decoder decodes (the others go plane by plane in Python)
_NATIVE_METHODS = frozenset({PlaneMethod.RAW, PlaneMethod.CONST, PlaneMethod.RANS32})


def _bind_native_decoder() -> bool:
    """Give the native chunk decoder XXH3 (of python-xxhash, the hash this module checks
    with) and the kernels' ungroup from separate planes, by address."""
    try:
        import ctypes

        import xxhash._xxhash as xx

        fn = ctypes.CDLL(xx.__file__).XXH3_64bits
        xxh3 = int(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    except (ImportError, OSError, AttributeError):  # pragma: no cover - unusual installs
        return False
    ungroup = kernels.ungroup_planes_address()
    return bool(xxh3 and ungroup) and rans.bind_decoder(xxh3, ungroup)


_NATIVE_DECODER = _bind_native_decoder()


def _decode_native(mv: memoryview, meta: ChunkMeta, base: U8 | None, out: U8, where: str,
                   verify_payload: bool) -> bool:
    """Decode the chunk in one native call with the GIL released (``mc_decode_chunk``: the
    payload hash, RAW planes read where they lie instead of copied, CONST/RANS32 planes, the
    inverse transform and the decoded bytes' hash), where it can: XXH3 chunk hashes, those
    plane methods, a transform with a native inverse, the native kernels in use. False: the
    per-plane path is to decode it; also when the native call finds a plane it cannot
    decode, so that the per-plane path names exactly what is wrong."""
    tr = None if meta.transform & ~(DELTA_BIT | 0x7F) else REGISTRY.get(meta.transform & 0x7F)
    if tr is None or tr.native_kind is None or meta.width not in tr.widths:
        return False
    kind = tr.native_kind
    if (meta.hash_version != 2 or not _NATIVE_DECODER or meta.is_delta != (base is not None)
            or (base is not None and (kind < 0 or base.size != meta.raw_size))
            or not rans.decoder_available() or not kernels.native_in_use()
            or any(m not in _NATIVE_METHODS for m, _ in meta.planes)
            or len(meta.planes) != len(plane_sizes(meta.transform, meta.width, meta.raw_size))):
        return False
    scratch = out if kind < 0 else _scratch("dec", meta.raw_size)
    code, _plane, got = rans.decode_chunk_native(
        mv, bytes(m for m, _ in meta.planes), [n for _, n in meta.planes], meta.width, kind,
        base, scratch, out, meta.payload_xxh64, meta.raw_xxh64, verify_payload)
    if code == rans.DEC_OK:
        return True
    if code == rans.DEC_PAYLOAD:
        raise ChecksumMismatch(f"{where} (stored payload)", meta.payload_xxh64, got)
    if code == rans.DEC_RAW:
        raise ChecksumMismatch(f"{where} (decoded bytes)", meta.raw_xxh64, got)
    return False


def decode_chunk(payload: bytes | memoryview, meta: ChunkMeta, base: U8 | None, out: U8, *,
                 where: str = "chunk", verify_payload: bool = True) -> None:
    """Decode ``payload`` into ``out`` (``meta.raw_size`` writable bytes).

    Verifies the payload hash first (unless the caller already did) and the raw hash last;
    raises :class:`ChecksumMismatch`/:class:`InvalidFormat` naming ``where``.  A delta chunk
    needs ``base`` (the same-size bytes it was XORed with).
    """
    mv = memoryview(payload).cast("B") if not isinstance(payload, memoryview) else payload
    if out.size != meta.raw_size:
        raise ShapeMismatch(f"{where}: output holds {out.size} bytes, chunk has {meta.raw_size}")
    if len(mv) != meta.stored_size:
        raise InvalidFormat(f"{where}: payload of {len(mv)} bytes, header says {meta.stored_size}")
    if _decode_native(mv, meta, base, out, where, verify_payload):
        return
    hasher = chunk_hasher(meta.hash_version)
    if verify_payload:
        got = hasher(mv)
        if got != meta.payload_xxh64:
            raise ChecksumMismatch(f"{where} (stored payload)", meta.payload_xxh64, got)
    tr = _check_transform(meta, where)
    if meta.is_delta:
        if base is None:
            raise InvalidFormat(f"{where}: delta chunk decoded without its base")
        if base.size != meta.raw_size:
            raise ShapeMismatch(f"{where}: delta base has {base.size} bytes, chunk "
                                f"{meta.raw_size}")
    sizes = plane_sizes(meta.transform, meta.width, meta.raw_size)
    if len(sizes) != len(meta.planes):
        raise InvalidFormat(f"{where}: {len(meta.planes)} planes, transform makes {len(sizes)}")
    direct = tr.identity and not meta.is_delta
    buf: U8 = out if direct else _scratch("dec", meta.raw_size)
    off = soff = 0
    for i, ((method, stored), n) in enumerate(zip(meta.planes, sizes, strict=True)):
        decode_plane(method, mv[soff:soff + stored], buf[off:off + n],
                     where=f"{where} plane {i}")
        off += n
        soff += stored
    if not direct:
        tr.inverse(buf, meta.width, base, out)
    got = hasher(out.data)
    if got != meta.raw_xxh64:
        raise ChecksumMismatch(f"{where} (decoded bytes)", meta.raw_xxh64, got)

