"""4-bit codes + HPΔKV XOR residual on real MiniLM weights: bit-exact and error-reducing."""

from __future__ import annotations

import pytest
import torch

from mithril_async.errors import UnsupportedDtype
from mithril_async.lossy.hpdkv import unpack_residuals
from mithril_async.lossy.nf4 import FP4_CODE, NF4_CODE, quantize_with_residuals

NAMES = ["encoder.layer.0.attention.self.query.weight", "encoder.layer.3.output.dense.weight",
         "encoder.layer.5.intermediate.dense.bias", "embeddings.LayerNorm.weight"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_dense_residual_recovers_real_weights_bit_exactly(
        minilm: dict[str, torch.Tensor], dtype: torch.dtype, kind: str) -> None:
    for name in NAMES:
        w = minilm[name].to(dtype)
        rq = quantize_with_residuals(w, kind=kind)  # type: ignore[arg-type]
        assert torch.equal(_bits(rq.recover()), _bits(w)), name
        assert not torch.equal(_bits(rq.dequantize()), _bits(w))  # the 4-bit copy is lossy
        assert rq.nbytes_quantized * 3 < w.numel() * 2  # ~4.5 bits per weight


def test_whole_layer_bit_exact_fp16(minilm: dict[str, torch.Tensor]) -> None:
    for name, w32 in minilm.items():
        if not name.startswith(("encoder.layer.2.", "embeddings.LayerNorm")):
            continue  # every tensor kind of one layer; the other layers add time, not coverage
        w = w32.to(torch.float16)
        assert torch.equal(_bits(quantize_with_residuals(w, compress=False).recover()), _bits(w))


def test_special_values_bit_exact() -> None:
    w = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    w[[0, 5, 70, 71, 200]] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 0.0],
                                          dtype=torch.float16)
    w_bits = _bits(w).clone()
    w_bits[10] = 0x7E01  # a NaN with a payload
    w = w_bits.view(torch.float16)
    assert torch.equal(_bits(quantize_with_residuals(w).recover()), w_bits)
    assert torch.equal(_bits(quantize_with_residuals(torch.tensor(1.5, dtype=torch.bfloat16))
                             .recover()), _bits(torch.tensor(1.5, dtype=torch.bfloat16)))


def test_topk_residual_reduces_error_measurably(minilm: dict[str, torch.Tensor]) -> None:
    w = minilm[NAMES[0]].to(torch.float16)
    base = quantize_with_residuals(w, store_topk=0.0)
    err0 = (base.recover().float() - w.float())
    prev_rmse, prev_max = err0.pow(2).mean().sqrt(), err0.abs().max()
    for frac in (0.01, 0.05, 0.1):
        rq = quantize_with_residuals(w, store_topk=frac)
        err = rq.recover().float() - w.float()
        rmse, mx = err.pow(2).mean().sqrt(), err.abs().max()
        assert rmse < prev_rmse and mx < prev_max
        exact = (_bits(rq.recover()) == _bits(w)).float().mean()
        assert exact >= frac  # at least the stored elements are exact
        prev_rmse, prev_max = rmse, mx
    assert prev_max < 0.25 * err0.abs().max()  # top-10 %: max error down > 4x
    assert torch.count_nonzero(unpack_residuals(rq.residual)) <= 0.1 * w.numel() + 1


def test_codebooks_and_refusals() -> None:
    assert len(NF4_CODE) == len(FP4_CODE) == 16
    assert (NF4_CODE[1:] > NF4_CODE[:-1]).all() and (FP4_CODE[1:] >= FP4_CODE[:-1]).all()
    with pytest.raises(UnsupportedDtype):
        quantize_with_residuals(torch.zeros(4))
    with pytest.raises(ValueError):
        quantize_with_residuals(torch.zeros(4, dtype=torch.float16), bits=3)
