"""Lossless fallback for keyframes and exact tensors: byte grouping + zstd, self-contained.

Why here: the lossy tier must store keyframes and every tensor the user marked exact
bit-for-bit, and must measure that cost honestly. When the main codec
(``mithril_async.codec.compress_state_dict``) is importable it is used for whole state dicts
(see :func:`lossless_state_size`); otherwise this module's per-tensor codec is used, which is
what ZipNN-style byte grouping + zstd gives without the exponent tricks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from mithril_async.errors import InvalidFormat

__all__ = ["decode_lossless", "encode_lossless", "inflate_exact", "lossless_backend",
           "lossless_state_size"]


def inflate_exact(blob: bytes, size: int, what: str) -> bytes:
    """``blob`` zstd-inflated to exactly ``size`` bytes, never more held in memory: corrupt
    data, or any other size, is an :class:`InvalidFormat` naming ``what``."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise InvalidFormat(f"{what} is corrupt: {exc}") from exc
    if len(raw) != size:
        raise InvalidFormat(f"{what} inflates to {len(raw)} bytes, not {size}")
    return raw


def encode_lossless(tensor: torch.Tensor, level: int = 3) -> bytes:
    """Byte-group a tensor's little-endian bytes by position within each element, then zstd."""
    t = tensor.detach().to("cpu").contiguous()
    width = t.element_size()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    grouped = raw.reshape(-1, width).T.tobytes() if width > 1 else raw.tobytes()
    return zstandard.ZstdCompressor(level=level).compress(grouped)


def decode_lossless(blob: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_lossless`; the inflated size must match shape and dtype."""
    width = torch.empty(0, dtype=dtype).element_size()
    expected = math.prod(shape) * width
    raw = inflate_exact(blob, expected, "lossless tensor payload")
    planes = np.frombuffer(raw, dtype=np.uint8)
    if width > 1:
        planes = planes.reshape(width, -1).T
    planes = np.array(planes, order="C", copy=True).reshape(-1)
    return torch.from_numpy(planes).view(dtype).reshape(shape)


def lossless_backend() -> str:
    """Which lossless codec sizes keyframes: the main codec when present, else this fallback."""
    try:
        from mithril_async.codec import compress_state_dict  # noqa: F401
    except ImportError:
        return "bytegroup+zstd (fallback)"
    return "mithril_async.codec.compress_state_dict"


def lossless_state_size(state: Mapping[str, torch.Tensor], level: int = 3,
                        previous: Mapping[str, torch.Tensor] | None = None) -> int:
    """Compressed bytes of a whole state dict with the best lossless codec available.

    ``previous`` (main codec only) XOR-delta codes against an earlier state.
    """
    try:
        from mithril_async.codec import compress_state_dict
    except ImportError:
        return sum(len(encode_lossless(t, level)) for t in state.values())
    out: Any = compress_state_dict(dict(state), previous=previous, level=level)
    if isinstance(out, bytes | bytearray | memoryview):
        return len(out)
    if isinstance(out, tuple) and out and isinstance(out[0], bytes | bytearray):
        return len(out[0])
    return sum(len(encode_lossless(t, level)) for t in state.values())
