"""ZipNN-style "tunable lossy" precision cast: ``q = round(x * 2**b)`` as integers, then zstd.

Why: fine-tuned weights carry many near-random low mantissa bits (noise saved to disk); snapping
to a fixed-point grid of step ``2**-b`` removes them, and the integers (byte-grouped, then zstd)
compress far better than the floats. We *round* rather than floor as the ZipNN text does: same
cost, half the error — ``|x̂ - x| <= 2**-(b+1)`` before the final cast to the tensor's dtype.

The bound is enforced like :mod:`mithril_async.lossy.quant`: the error is measured after
dequantising to the tensor's dtype; ``raise_bits`` picks ``b`` from the bound and increases it
until the measured error fits (up to the int64 range), ``raise`` raises
:class:`ErrorBoundExceeded` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from mithril_async.errors import ErrorBoundExceeded, InvalidFormat, UnsupportedDtype
from mithril_async.lossy.lossless import inflate_exact
from mithril_async.lossy.quant import ErrorBound

_MAX_ABS_INT = float(2**62)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = ["FixedPointTensor", "bits_for_bound", "fixed_point_decode", "fixed_point_encode"]


@dataclass
class FixedPointTensor:
    """Fixed-point integers (zstd of zigzagged, byte-grouped int32/int64 LE) and their scale."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    frac_bits: int
    int_width: int  # 4 or 8 bytes
    payload: bytes
    max_abs_error: float
    bound: float

    @property
    def nbytes(self) -> int:
        return len(self.payload) + 2

    def params(self) -> dict[str, Any]:
        return {"codec": "fixed_point", "frac_bits": self.frac_bits, "int_width": self.int_width,
                "max_abs_error": self.max_abs_error, "bound": self.bound}

    def dequantize(self) -> torch.Tensor:
        return fixed_point_decode(self)


def bits_for_bound(bound: float) -> int:
    """Smallest ``b`` whose rounding error ``2**-(b+1)`` is within ``bound``."""
    if not bound > 0:
        raise ErrorBoundExceeded(f"fixed-point cast cannot meet a bound of {bound}")
    return max(0, math.ceil(-math.log2(2 * bound))) if bound < 0.5 else 0


def _group(ints: np.ndarray) -> bytes:
    """Zigzag (small |q| -> small unsigned, so high bytes are zero), then byte grouping."""
    width = ints.dtype.itemsize
    shift = 8 * width - 1
    zig = (ints << 1) ^ (ints >> shift)
    return np.ascontiguousarray(zig.view(np.uint8).reshape(-1, width).T).tobytes()


def _ungroup(raw: bytes, width: int, count: int) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, count)
    zig = np.ascontiguousarray(planes.T).view("<u4" if width == 4 else "<u8").reshape(-1)
    signed = np.dtype("<i4" if width == 4 else "<i8")
    return (zig >> 1).astype(signed) ^ -(zig & 1).astype(signed)


def _cast(flat: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    scaled = np.rint(flat * 2.0**b)
    if scaled.size and float(np.abs(scaled).max()) >= _MAX_ABS_INT:
        raise OverflowError
    big = scaled.size and float(np.abs(scaled).max()) >= 2**31
    ints = scaled.astype("<i8" if big else "<i4")
    return ints, ints.astype(np.float64) / 2.0**b


def fixed_point_encode(
    tensor: torch.Tensor,
    frac_bits: int | None = None,
    bound: ErrorBound | None = None,
    level: int = 3,
    name: str = "<tensor>",
) -> FixedPointTensor:
    """Cast to fixed point with ``frac_bits`` fractional bits (or the fewest meeting ``bound``)."""
    if tensor.dtype not in _FLOAT_DTYPES:
        raise UnsupportedDtype(f"{name}: fixed-point cast needs a float tensor, got {tensor.dtype}")
    flat = tensor.detach().to("cpu", torch.float64).reshape(-1).numpy()
    if flat.size and not np.isfinite(flat).all():
        raise ErrorBoundExceeded(f"{name}: non-finite values cannot be cast to fixed point")
    absmax = float(np.abs(flat).max()) if flat.size else 0.0
    limit = (bound or ErrorBound()).limit(absmax)
    if frac_bits is None:
        if not math.isfinite(limit):
            raise ValueError(f"{name}: give frac_bits or a finite error bound")
        frac_bits = bits_for_bound(limit)
    b = frac_bits
    while True:
        try:
            ints, approx = _cast(flat, b)
        except OverflowError as exc:
            raise ErrorBoundExceeded(
                f"{name}: 2**{b} * max|x| overflows int64; bound {limit:.3g} unreachable") from exc
        recon = torch.from_numpy(approx).to(tensor.dtype).to(torch.float64).numpy()
        err = float(np.abs(recon - flat).max()) if flat.size else 0.0
        if err <= limit:
            break
        if bound is None or bound.on_violation == "raise":
            raise ErrorBoundExceeded(f"{name}: error {err:.3g} > bound {limit:.3g} at b={b}")
        b += 1
    payload = zstandard.ZstdCompressor(level=level).compress(_group(ints))
    return FixedPointTensor(tuple(tensor.shape), tensor.dtype, b, ints.dtype.itemsize, payload,
                            err, limit)


def fixed_point_decode(fp: FixedPointTensor) -> torch.Tensor:
    """Integers back to floats: ``q / 2**b`` in float64, then the tensor's dtype."""
    count = math.prod(fp.shape)
    if fp.int_width not in (4, 8):
        raise InvalidFormat(f"fixed-point int width {fp.int_width} is not 4 or 8")
    expected = count * fp.int_width
    raw = inflate_exact(fp.payload, expected, "fixed-point payload")
    values = _ungroup(raw, fp.int_width, count).astype(np.float64) / 2.0**fp.frac_bits
    return torch.from_numpy(values).to(fp.dtype).reshape(fp.shape)
