"""Dense bit packing of small unsigned codes (1..16 bits each), little overhead, numpy only.

Why not one byte per code: a 4-bit quantiser that stores bytes is only a 2x quantiser on disk.
Codes are packed MSB-first into a contiguous bit stream (``numpy.packbits`` order), so the
packed size is exactly ``ceil(count * bits / 8)`` bytes.
"""

from __future__ import annotations

import numpy as np

from mithril_async.errors import InvalidFormat

__all__ = ["pack_codes", "packed_size", "unpack_codes"]


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits occupy once packed."""
    return (count * bits + 7) // 8


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """Pack unsigned integer codes (each < 2**bits) into a bit stream."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")
    flat = np.ascontiguousarray(codes, dtype=np.uint16).reshape(-1)
    if bits == 8:
        return flat.astype(np.uint8).tobytes()
    if bits == 16:
        return flat.astype(">u2").tobytes()
    if bits == 4:
        padded = np.zeros(flat.size + (flat.size & 1), dtype=np.uint8)
        padded[: flat.size] = flat
        return ((padded[0::2] << 4) | padded[1::2]).astype(np.uint8).tobytes()
    as_bytes = flat.astype(">u2").view(np.uint8).reshape(-1, 2)
    bit_matrix = np.unpackbits(as_bytes, axis=1)[:, 16 - bits :]
    return np.packbits(bit_matrix.reshape(-1)).tobytes()


def unpack_codes(buf: bytes | memoryview, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`; the buffer length must match exactly."""
    if not 1 <= bits <= 16:
        raise InvalidFormat(f"bits must be in 1..16, got {bits}")
    need = packed_size(count, bits)
    if len(buf) != need:
        raise InvalidFormat(f"{count} codes of {bits} bits need {need} bytes, got {len(buf)}")
    raw = np.frombuffer(buf, dtype=np.uint8)
    if bits == 8:
        return raw.astype(np.uint16)
    if bits == 16:
        return np.frombuffer(buf, dtype=">u2").astype(np.uint16)
    if bits == 4:
        out = np.empty(raw.size * 2, dtype=np.uint16)
        out[0::2] = raw >> 4
        out[1::2] = raw & 0x0F
        return out[:count]
    bit_stream = np.unpackbits(raw)[: count * bits].reshape(count, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint32)
    return (bit_stream.astype(np.uint32) @ weights).astype(np.uint16)
