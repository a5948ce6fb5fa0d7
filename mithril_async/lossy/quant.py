"""Uniform per-block quantisation with an enforced error bound, and sensitivity-aware bits.

Why per block: one (min, scale) pair per block of ``block_size`` values keeps outliers local,
so a single large weight does not flatten the resolution of the whole tensor.

Why an *enforced* bound: lossy storage is only safe to opt into when the user can say "never
worse than X". Every block's error is *measured* after dequantising to the tensor's own dtype
(so float rounding is counted, not assumed away). A block over the bound either gets more bits
(``on_violation="raise_bits"``, the default: the smallest width that should fit, then +1 until
it does, up to 16 bits) or the call raises :class:`ErrorBoundExceeded` (``"raise"``). A bound
that 16 bits cannot meet (e.g. below the dtype's own rounding) always raises.

Sensitivity mode (DynaQuant-style): blocks whose sensitivity (gradient magnitude, Adam's second
moment, ...) is high get more bits, low ones fewer, at the same average budget — the classic
rate-distortion allocation ``b_i = b + 0.5 * log2(s_i / geomean(s))``, rounded and clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from mithril_async.errors import ErrorBoundExceeded, InvalidFormat, UnsupportedDtype
from mithril_async.lossy.bitpack import pack_codes, packed_size, unpack_codes

MIN_BITS = 1
MAX_BITS = 16
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = [
    "ErrorBound",
    "QuantizedTensor",
    "allocate_bits",
    "dequantize",
    "quantize",
]


@dataclass(frozen=True)
class ErrorBound:
    """The worst error a user accepts for one tensor.

    ``max_abs`` bounds ``|x̂ - x|`` elementwise; ``rel`` bounds it relative to the tensor's
    largest magnitude (``rel * max|x|``; elementwise-relative bounds are not offered because
    no uniform grid can honour them near zero). When both are set the tighter one applies.
    """

    max_abs: float | None = None
    rel: float | None = None
    on_violation: Literal["raise", "raise_bits"] = "raise_bits"

    def __post_init__(self) -> None:
        for name in ("max_abs", "rel"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"ErrorBound.{name} must be a finite number >= 0, got {value}")
        if self.on_violation not in ("raise", "raise_bits"):
            raise ValueError(
                f"ErrorBound.on_violation must be raise|raise_bits, got {self.on_violation}")

    def limit(self, absmax: float) -> float:
        """The absolute error allowed for a tensor whose largest magnitude is ``absmax``."""
        limits = [math.inf]
        if self.max_abs is not None:
            limits.append(self.max_abs)
        if self.rel is not None:
            limits.append(self.rel * absmax)
        return min(limits)


@dataclass
class QuantizedTensor:
    """Codes plus the per-block (min, scale, bits) needed to dequantise; plain data only."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    block_size: int
    bits: np.ndarray  # uint8 per block
    mins: np.ndarray  # float32 per block
    scales: np.ndarray  # float32 per block
    payload: bytes  # codes grouped by bit width (ascending), blocks in index order per group
    max_abs_error: float  # measured, after dequantising to ``dtype``
    bound: float  # the absolute bound enforced (inf when none)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Stored size: payload + 9 bytes of metadata per block (bits, min, scale)."""
        return len(self.payload) + 9 * len(self.bits)

    def params(self) -> dict[str, Any]:
        """What a manifest records about how this tensor was made lossy."""
        return {
            "codec": "uniform_block",
            "block_size": self.block_size,
            "mean_bits": float(self.bits.mean()) if len(self.bits) else 0.0,
            "max_abs_error": self.max_abs_error,
            "bound": self.bound,
            **self.extra,
        }

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def _blocks(flat: np.ndarray, block_size: int) -> np.ndarray:
    """(nblocks, block_size) view, the tail padded with its last value (no effect on range)."""
    nblocks = -(-flat.size // block_size)
    pad = nblocks * block_size - flat.size
    if pad:
        flat = np.concatenate([flat, np.full(pad, flat[-1], dtype=flat.dtype)])
    return flat.reshape(nblocks, block_size)


def _encode_blocks(blocks: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, ...]:
    """Codes, mins, scales for each block at its own bit width (float64 arithmetic)."""
    mins = blocks.min(axis=1).astype(np.float32)
    levels = (np.left_shift(1, bits.astype(np.int64)) - 1).astype(np.float64)
    span = blocks.max(axis=1).astype(np.float64) - mins.astype(np.float64)
    scales = (span / levels).astype(np.float32)
    safe = np.where(scales > 0, scales, 1).astype(np.float64)
    codes = np.rint((blocks - mins[:, None].astype(np.float64)) / safe[:, None])
    codes = np.clip(codes, 0, levels[:, None]).astype(np.uint16)
    return codes, mins, scales


def _decode_blocks(codes: np.ndarray, mins: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The one dequantisation rule, shared by encoder (to measure) and decoder: float32."""
    return mins[:, None] + codes.astype(np.float32) * scales[:, None]


def _as_dtype(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Round float32 values to ``dtype`` and back to float64, exactly as a reader would see them."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype).to(torch.float64).numpy()


def _block_errors(blocks: np.ndarray, codes: np.ndarray, mins: np.ndarray,
                  scales: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    recon = _as_dtype(_decode_blocks(codes, mins, scales), dtype)
    return np.abs(recon - blocks).max(axis=1)


def allocate_bits(
    sensitivity: torch.Tensor,
    block_size: int,
    target_bits: float,
    min_bits: int = 2,
    max_bits: int = 8,
) -> np.ndarray:
    """Per-block bit widths from a sensitivity tensor, averaging at most ``target_bits``.

    Block score = mean ``|sensitivity|``; widths follow ``target + 0.5*log2(s/geomean(s)) + c``
    with one offset ``c`` (found by bisection) so the rounded, clipped widths fit the budget.
    Higher score never gets fewer bits (the map is monotone).
    """
    if not min_bits <= target_bits <= max_bits:
        raise ValueError(f"target_bits {target_bits} outside [{min_bits}, {max_bits}]")
    flat = sensitivity.detach().reshape(-1).to(torch.float64).abs().numpy()
    if flat.size == 0:
        return np.zeros(0, dtype=np.uint8)
    score = _blocks(np.nan_to_num(flat, nan=0.0, posinf=0.0), block_size).mean(axis=1)
    log_s = np.log2(np.maximum(score, 1e-30))
    base = target_bits + 0.5 * (log_s - log_s.mean())
    budget = target_bits * score.size

    def widths(offset: float) -> np.ndarray:
        return np.clip(np.floor(base + offset + 0.5), min_bits, max_bits)

    lo, hi = -64.0, 64.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if widths(mid).sum() <= budget + 1e-9:
            lo = mid
        else:
            hi = mid
    return widths(lo).astype(np.uint8)


def quantize(
    tensor: torch.Tensor,
    bits: int | np.ndarray = 4,
    block_size: int = 64,
    bound: ErrorBound | None = None,
    sensitivity: torch.Tensor | None = None,
    name: str = "<tensor>",
) -> QuantizedTensor:
    """Quantise a float tensor per block; enforce ``bound`` as described in the module doc.

    ``bits`` is the target width (2..8) or an explicit per-block array; with ``sensitivity``
    the target is redistributed across blocks by :func:`allocate_bits`.
    """
    if tensor.dtype not in _FLOAT_DTYPES:
        raise UnsupportedDtype(
            f"{name}: lossy quantisation needs a float tensor, got {tensor.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    flat = tensor.detach().to("cpu", torch.float64).reshape(-1).numpy()
    nblocks = -(-flat.size // block_size)
    if isinstance(bits, np.ndarray):
        widths = bits.astype(np.uint8).copy()
        if widths.shape != (nblocks,):
            raise ValueError(f"{name}: {widths.shape} bit widths for {nblocks} blocks")
    else:
        if not 2 <= bits <= 8:
            raise ValueError(f"{name}: target bits must be in 2..8, got {bits}")
        if sensitivity is not None:
            if sensitivity.numel() != flat.size:
                raise ValueError(f"{name}: sensitivity has {sensitivity.numel()} elements")
            widths = allocate_bits(sensitivity, block_size, bits)
        else:
            widths = np.full(nblocks, bits, dtype=np.uint8)
    if np.any((widths < MIN_BITS) | (widths > MAX_BITS)):
        raise ValueError(f"{name}: bit widths must be in {MIN_BITS}..{MAX_BITS}")
    if flat.size and not np.isfinite(flat).all():
        raise ErrorBoundExceeded(f"{name}: non-finite values cannot be quantised")
    absmax = float(np.abs(flat).max()) if flat.size else 0.0
    limit = (bound or ErrorBound()).limit(absmax)
    if flat.size == 0:
        return QuantizedTensor(tuple(tensor.shape), tensor.dtype, block_size, widths,
                               np.zeros(0, np.float32), np.zeros(0, np.float32), b"", 0.0, limit)
    blocks = _blocks(flat, block_size)
    codes, mins, scales = _encode_blocks(blocks, widths)
    errors = _block_errors(blocks, codes, mins, scales, tensor.dtype)
    if bound is not None:
        codes, mins, scales, widths, errors = _enforce(
            blocks, codes, mins, scales, widths, errors, limit, bound, tensor.dtype, name)
    payload = b"".join(
        pack_codes(codes[widths == w], int(w)) for w in np.unique(widths)
    )
    return QuantizedTensor(tuple(tensor.shape), tensor.dtype, block_size, widths, mins, scales,
                           payload, float(errors.max()), limit)


def _enforce(blocks: np.ndarray, codes: np.ndarray, mins: np.ndarray, scales: np.ndarray,
             widths: np.ndarray, errors: np.ndarray, limit: float, bound: ErrorBound,
             dtype: torch.dtype, name: str) -> tuple[np.ndarray, ...]:
    """Raise bits of the blocks over ``limit`` (or raise), re-measuring after each pass."""
    over = np.nonzero(errors > limit)[0]
    if over.size and bound.on_violation == "raise":
        i = int(over[0])
        raise ErrorBoundExceeded(
            f"{name}: block {i} error {errors[i]:.3g} > bound {limit:.3g} at {widths[i]} bits "
            f"({over.size} blocks over)")
    if over.size:
        span = blocks[over].max(axis=1) - blocks[over].min(axis=1)
        need = np.ceil(np.log2(span / (2 * limit) + 1)) if limit > 0 else np.full(over.size, 16)
        widths[over] = np.clip(np.maximum(need, widths[over] + 1), MIN_BITS, MAX_BITS)
    while over.size:
        c, m, s = _encode_blocks(blocks[over], widths[over])
        codes[over], mins[over], scales[over] = c, m, s
        errors[over] = _block_errors(blocks[over], c, m, s, dtype)
        still = over[errors[over] > limit]
        stuck = still[widths[still] >= MAX_BITS]
        if stuck.size:
            i = int(stuck[0])
            raise ErrorBoundExceeded(
                f"{name}: block {i} error {errors[i]:.3g} > bound {limit:.3g} even at "
                f"{MAX_BITS} bits (the bound is below what the dtype {dtype} can represent)")
        widths[still] += 1
        over = still
    return codes, mins, scales, widths, errors


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Rebuild the tensor (in its original dtype) from a :class:`QuantizedTensor`."""
    n, nblocks = q.numel, len(q.bits)
    if nblocks != -(-n // q.block_size) or len(q.mins) != nblocks or len(q.scales) != nblocks:
        raise InvalidFormat(f"quantised tensor of shape {q.shape} has {nblocks} block records")
    if n == 0:
        return torch.empty(q.shape, dtype=q.dtype)
    codes = np.zeros((nblocks, q.block_size), dtype=np.uint16)
    view = memoryview(q.payload)
    pos = 0
    for w in np.unique(q.bits):
        sel = q.bits == w
        count = int(sel.sum()) * q.block_size
        size = packed_size(count, int(w))
        if pos + size > len(view):
            raise InvalidFormat(f"quantised payload is truncated at the {w}-bit group")
        codes[sel] = unpack_codes(view[pos : pos + size], int(w), count).reshape(-1, q.block_size)
        pos += size
    if pos != len(view):
        raise InvalidFormat(f"quantised payload has {len(view) - pos} trailing bytes")
    values = _decode_blocks(codes, q.mins.astype(np.float32), q.scales.astype(np.float32))
    return torch.from_numpy(values.reshape(-1)[:n].copy()).to(q.dtype).reshape(q.shape)
