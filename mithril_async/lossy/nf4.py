"""4-bit (NF4 / FP4) blockwise quantisation plus an HPΔKV residual that undoes it.

The residual rule (why XOR, not subtraction): the obvious residual ``r = x - x̂`` rounded to
fp16/bf16 does *not* always give back ``x`` as ``x̂ + r``: the exact difference of two 16-bit
floats can need more significand bits than 16-bit floats have, the addition rounds again, and
signed zeros / NaN payloads are lost outright. So the residual word stored in HPΔKV is the
bit-level XOR ``bits(x) ^ bits(x̂)`` (carried in the tensor's own dtype as 16-bit words).

* Dense residual: ``bits(x̂) ^ r`` gives every bit of every element back — proven by the tests
  on real MiniLM weights, including signed zeros, infinities and NaN payloads.
* Top-k residual: the k elements with the largest ``|x - x̂|`` (ranked in float32) get their
  XOR word, and so come back *exactly*; the others keep their 4-bit value. The error drop is
  therefore exactly the removal of the largest errors (numbers in docs/FORMAT.md (HPΔKV section)).

Quantisation itself follows QLoRA/bitsandbytes: per block of ``block_size`` values, scale by the
block's absmax (float32), pick the nearest of 16 code values, store two codes per byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from mithril_async.errors import InvalidFormat, UnsupportedDtype
from mithril_async.lossy.bitpack import pack_codes, unpack_codes
from mithril_async.lossy.hpdkv import pack_residuals, unpack_residuals

#: The 16 NormalFloat-4 levels of QLoRA (Dettmers et al. 2023), ascending.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)
#: FP4 (e2m1) levels normalised to [-1, 1]; ±0 both present so all 16 codes are used.
_E2M1 = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_CODE = np.array([*sorted({s * v / 6.0 for s in (-1.0, 1.0) for v in _E2M1}), 0.0, 0.0],
                    dtype=np.float32)
FP4_CODE.sort()
_CODEBOOKS = {"nf4": NF4_CODE, "fp4": FP4_CODE}

__all__ = ["FP4_CODE", "NF4_CODE", "ResidualQuantized", "quantize_with_residuals"]


@dataclass
class ResidualQuantized:
    """A 4-bit copy (``codes`` + ``absmax``) and the HPΔKV residual that restores the original."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    block_size: int
    codes: bytes  # two 4-bit codes per byte
    absmax: torch.Tensor  # float32, one per block
    residual: bytes  # HPΔKV v1 blob of XOR words

    def dequantize(self) -> torch.Tensor:
        """The 4-bit approximation, in the original dtype."""
        n = math.prod(self.shape)
        codes = unpack_codes(self.codes, 4, n).astype(np.int64)
        return _dequant(codes, self.absmax, self.block_size, self.kind, self.dtype, self.shape)

    def recover(self) -> torch.Tensor:
        """Apply the residual: exact where it is stored (everywhere when dense)."""
        approx = self.dequantize()
        xor = unpack_residuals(self.residual)
        if xor.shape != approx.shape or xor.dtype != approx.dtype:
            raise InvalidFormat(
                f"residual {tuple(xor.shape)}/{xor.dtype} does not match {self.shape}/{self.dtype}")
        return (approx.view(torch.int16) ^ xor.view(torch.int16)).view(self.dtype)

    @property
    def nbytes_quantized(self) -> int:
        return len(self.codes) + 4 * self.absmax.numel()


def _dequant(codes: np.ndarray, absmax: torch.Tensor, block_size: int, kind: str,
             dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = codes.size
    if absmax.numel() != -(-n // block_size):
        raise InvalidFormat(f"{absmax.numel()} absmax values for {n} elements")
    levels = torch.from_numpy(_CODEBOOKS[kind])[torch.from_numpy(codes)]
    scale = absmax.to(torch.float32).repeat_interleave(block_size)[:n]
    return (levels * scale).to(dtype).reshape(shape)


def quantize_with_residuals(
    weights: torch.Tensor,
    bits: int = 4,
    *,
    kind: Literal["nf4", "fp4"] = "nf4",
    block_size: int = 64,
    store_topk: float | None = None,
    compress: bool = True,
) -> ResidualQuantized:
    """Quantise fp16/bf16 ``weights`` to 4-bit codes and attach an HPΔKV XOR residual.

    ``store_topk=None`` writes a dense residual (bit-exact recovery); a fraction keeps the
    residual words of the largest-error elements only.
    """
    if bits != 4:
        raise ValueError(f"only 4-bit NF4/FP4 codes are implemented, got bits={bits}")
    if kind not in _CODEBOOKS:
        raise ValueError(f"kind must be 'nf4' or 'fp4', got {kind!r}")
    if weights.dtype not in (torch.float16, torch.bfloat16):
        raise UnsupportedDtype(
            f"HPΔKV residuals need float16/bfloat16 weights, got {weights.dtype}")
    x = weights.detach().to("cpu").contiguous()
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nblocks = -(-n // block_size)
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32)
    padded[:n] = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
    absmax = padded.reshape(nblocks, block_size).abs().amax(dim=1) if n else torch.zeros(0)
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scaled = (padded.reshape(nblocks, block_size) / absmax[:, None]).reshape(-1)[:n].numpy()
    book = _CODEBOOKS[kind]
    mids = (book[1:] + book[:-1]) / 2
    codes = np.searchsorted(mids, scaled).astype(np.int64)
    approx = _dequant(codes, absmax, block_size, kind, x.dtype, tuple(x.shape))
    xor = (x.view(torch.int16) ^ approx.view(torch.int16)).view(x.dtype)
    scores = (flat - approx.reshape(-1).to(torch.float32)).abs()
    residual = pack_residuals(xor, store_topk=store_topk, compress=compress, scores=scores)
    return ResidualQuantized(tuple(x.shape), x.dtype, kind, block_size,
                             pack_codes(codes.astype(np.uint16), 4), absmax, residual)
