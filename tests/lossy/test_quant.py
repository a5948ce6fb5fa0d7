"""Uniform per-block, sensitivity-aware and fixed-point quantisers: bounds are enforced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mithril_async.errors import ErrorBoundExceeded, UnsupportedDtype
from mithril_async.lossy.bitpack import pack_codes, unpack_codes
from mithril_async.lossy.fixedpoint import fixed_point_decode, fixed_point_encode
from mithril_async.lossy.quant import ErrorBound, allocate_bits, dequantize, quantize

FLOATS = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("bits", range(1, 17))
def test_bitpack_roundtrip(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=1001).astype(np.uint16)
    buf = pack_codes(codes, bits)
    assert len(buf) == (1001 * bits + 7) // 8
    assert np.array_equal(unpack_codes(buf, bits, 1001), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_uniform_error_is_half_step(bits: int, dtype: torch.dtype) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(bits)).to(dtype)
    q = quantize(x, bits=bits, block_size=64)
    y = dequantize(q)
    assert y.dtype == dtype and y.shape == x.shape
    assert _err(y, x) == pytest.approx(q.max_abs_error)
    step = (q.scales.astype(np.float64)).max()
    assert q.max_abs_error <= step / 2 * 1.01 + float(x.float().abs().max()) * 2.0**-8
    assert q.nbytes < x.numel() * x.element_size()


@settings(max_examples=60, deadline=None)
@given(st.lists(FLOATS, min_size=0, max_size=300), st.integers(2, 8),
       st.sampled_from([1, 7, 64]), st.floats(1e-4, 10.0), st.booleans())
def test_bound_is_enforced_or_raises(values: list[float], bits: int, block: int,
                                     max_abs: float, relative: bool) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    bound = ErrorBound(rel=max_abs / 10) if relative else ErrorBound(max_abs=max_abs)
    try:
        q = quantize(x, bits=bits, block_size=block, bound=bound)
    except ErrorBoundExceeded:
        return
    limit = bound.limit(float(x.abs().max()) if x.numel() else 0.0)
    assert _err(dequantize(q), x) <= limit
    assert q.max_abs_error <= limit


def test_raise_policy_raises_and_raise_bits_adds_bits() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ErrorBoundExceeded, match="block"):
        quantize(x, bits=2, bound=ErrorBound(max_abs=1e-3, on_violation="raise"))
    q = quantize(x, bits=2, bound=ErrorBound(max_abs=1e-3))
    assert q.bits.min() > 2 and q.max_abs_error <= 1e-3
    with pytest.raises(ErrorBoundExceeded, match="16 bits"):  # below bf16 resolution
        quantize(x.to(torch.bfloat16), bits=4, bound=ErrorBound(max_abs=1e-9))
    with pytest.raises(ErrorBoundExceeded, match="non-finite"):
        quantize(torch.tensor([1.0, float("nan")]), bits=4)
    with pytest.raises(UnsupportedDtype):
        quantize(torch.arange(4), bits=4)


def test_sensitivity_gives_more_bits_where_sensitive() -> None:
    x = torch.randn(64 * 32, generator=torch.Generator().manual_seed(4))
    sens = torch.ones_like(x)
    sens[: 64 * 8] = 100.0  # first 8 blocks very sensitive
    sens[-64 * 8 :] = 0.01  # last 8 blocks barely
    q = quantize(x, bits=4, block_size=64, sensitivity=sens)
    assert q.bits[:8].min() > q.bits[8:24].max() >= q.bits[8:24].min() > q.bits[24:].max()
    assert q.bits.mean() <= 4
    flat_err = (dequantize(q) - x).abs().reshape(32, 64).amax(dim=1)
    assert flat_err[:8].mean() < flat_err[24:].mean()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=400),
       st.floats(2, 8))
def test_allocate_bits_monotone_and_in_budget(sens: list[float], target: float) -> None:
    s = torch.tensor(sens, dtype=torch.float64)
    bits = allocate_bits(s, block_size=4, target_bits=target)
    assert bits.min() >= 2 and bits.max() <= 8
    assert bits.mean() <= target + 1e-9
    score = np.array([np.mean(np.abs(sens[i : i + 4] + [sens[-1]] * max(0, i + 4 - len(sens))))
                      for i in range(0, len(sens), 4)])
    order = np.argsort(score, kind="stable")
    assert np.all(np.diff(bits[order].astype(int)) >= 0) or np.allclose(
        np.diff(score[order]), 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(FLOATS, min_size=0, max_size=200), st.floats(1e-5, 1.0),
       st.sampled_from([torch.float32, torch.float64]))
def test_fixed_point_bound(values: list[float], max_abs: float, dtype: torch.dtype) -> None:
    x = torch.tensor(values, dtype=dtype)
    fp = fixed_point_encode(x, bound=ErrorBound(max_abs=max_abs))
    y = fixed_point_decode(fp)
    assert y.dtype == dtype and y.shape == x.shape
    assert _err(y, x) <= max_abs and fp.max_abs_error <= max_abs
    assert fp.frac_bits >= 0


def test_fixed_point_compresses_and_raises() -> None:
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(5)) * 0.02
    fp = fixed_point_encode(x, frac_bits=10)
    assert fp.max_abs_error <= 2.0**-11
    assert fp.nbytes * 3 < x.numel() * 4  # > 3x vs fp32
    with pytest.raises(ErrorBoundExceeded):
        fixed_point_encode(x, frac_bits=4, bound=ErrorBound(max_abs=1e-4, on_violation="raise"))
    with pytest.raises(ErrorBoundExceeded):
        fixed_point_encode(torch.tensor([1e30]), bound=ErrorBound(max_abs=1e-12))


def test_a_fixed_point_payload_inflates_to_exactly_its_declared_size() -> None:
    """Corrupt bytes, a payload of another size, and a zero-element tensor with a payload:
    each an InvalidFormat naming the payload."""
    import dataclasses

    import zstandard

    from mithril_async.errors import InvalidFormat

    fp = fixed_point_encode(torch.linspace(-1, 1, 64), frac_bits=8)
    with pytest.raises(InvalidFormat, match="fixed-point payload is corrupt"):
        fixed_point_decode(dataclasses.replace(fp, payload=b"not zstd"))
    longer = zstandard.ZstdCompressor().compress(bytes(64 * fp.int_width + 1))
    with pytest.raises(InvalidFormat, match="fixed-point payload"):
        fixed_point_decode(dataclasses.replace(fp, payload=longer))
    empty = dataclasses.replace(fp, shape=(0,), payload=zstandard.ZstdCompressor(
        write_content_size=False).compress(bytes(1 << 20)))
    with pytest.raises(InvalidFormat, match="fixed-point payload"):
        fixed_point_decode(empty)
