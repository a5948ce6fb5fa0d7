"""NaN/Inf counting in the encoder's pass over the bytes (the save's non-finite guard).

Why: a save decides from these counts whether a version may become ``latest``; a kernel that
miscounts on one SIMD level, at a block edge, in a tail, or that counts the XOR delta instead
of the values would hold a healthy version or let a diverged one through. Every float format
is checked at every level this CPU has against the numpy oracle, and the oracle against the
floats' own semantics (``isnan`` / ``isinf`` after a widening conversion).
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
import torch

from mithril_async.codec import kernels as K
from mithril_async.codec import kernels_ref as R
from mithril_async.codec.chunk import CodecParams, encode_chunk, encode_chunks
from mithril_async.codec.dtypes import DTYPES
from tests.codec.test_kernels import backend

LEVELS = K.available_backends()  # numpy and every native level of this CPU
#: the float formats (a complex dtype is counted in its component's format)
FORMATS = sorted((n, c) for n, c in R.NONFINITE_FORMATS.items() if not n.startswith("complex"))
#: element counts around the SIMD blocks (16 / 32 elements, 4-vector copy blocks) and tails
COUNTS = [0, 1, 15, 31, 32, 33, 64, 127, 129, 1000, 4099]


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def _specials(code: int) -> list[int]:
    """Bit patterns of NaN, Inf and their near misses for format ``code``."""
    width, mask, want, has_inf = R.NONFINITE_SPECS[code]
    sign = 1 << (8 * width - 1)
    low = mask & -mask  # lowest exponent bit
    return [want, want | 1, want | sign, mask - low, mask ^ low, 0, sign, (1 << (8 * width)) - 1,
            *([mask, mask | sign] if has_inf else [])]


def _values(code: int, n: int, seed: int) -> np.ndarray:
    """``n`` random elements of format ``code`` as bytes, with specials at block edges and
    random places."""
    width = R.NONFINITE_SPECS[code][0]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, n * width, dtype=np.uint8)
    bits = raw.view(f"<u{width}")
    specials = _specials(code)
    spots = {0, 15, 16, 31, 32, 127, n - 1, *rng.integers(0, max(n, 1), 6).tolist()}
    for k, i in enumerate(sorted(x for x in spots if 0 <= x < n)):
        bits[i] = specials[k % len(specials)]
    return raw


@pytest.mark.parametrize(("name", "code"), FORMATS)
def test_oracle_counts_what_the_floats_say(name: str, code: int) -> None:
    width = R.NONFINITE_SPECS[code][0]
    if width == 1:  # every bit pattern
        raw = np.arange(256, dtype=np.uint8)
    else:
        raw = np.concatenate([_values(code, 5000, s) for s in range(3)])
    with np.errstate(invalid="ignore"):  # NaN payloads do not survive the cast
        wide = raw.view(_np_dtype(name)).astype(np.float64)
    assert R.count_nonfinite(raw, code) == (int(np.isnan(wide).sum()), int(np.isinf(wide).sum()))


def test_every_float_dtype_with_nan_or_inf_has_a_format() -> None:
    for name, info in DTYPES.items():
        if info.kind not in ("float", "complex") or name == "float4_e2m1fn_x2":
            continue  # fp4 has neither
        code = R.NONFINITE_FORMATS[name]
        assert R.NONFINITE_SPECS[code][0] == info.group_width, name
    assert "float8_e4m3fn" in R.NONFINITE_FORMATS
    # e4m3fn has no Inf: its all-ones magnitude is NaN, S.1111.000 is a finite 256
    code = R.NONFINITE_FORMATS["float8_e4m3fn"]
    assert R.count_nonfinite(np.array([0x7F, 0xFF, 0x78, 0xF8], np.uint8), code) == (2, 0)


Run = tuple[str, Callable[[K.NonFiniteTally], np.ndarray], np.ndarray | None]


def _kernel_runs(a: np.ndarray, b: np.ndarray, width: int, kind: str | None) -> list[Run]:
    """Every kernel that counts, on ``a`` (with ``b`` as the XOR base), and what it must
    write (None: nothing)."""
    runs: list[Run] = [
        ("count", lambda t: K.count_nonfinite(a, t).counts, None),
        ("copy", lambda t: K.copy(a, tally=t), a),
        ("xor", lambda t: K.xor(a, b, tally=t), R.xor(a, b)),
    ]
    if width > 1:
        runs += [("group", lambda t: K.group(a, width, tally=t), R.group(a, width)),
                 ("xor_group", lambda t: K.xor_group(a, b, width, tally=t),
                  R.xor_group(a, b, width))]
    if kind is not None:
        runs += [("exp_group", lambda t: K.exp_group(a, kind, tally=t), R.exp_group(a, kind)),
                 ("exp_group delta", lambda t: K.exp_group(a, kind, b, tally=t),
                  R.exp_group(a, kind, b))]
    return runs


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("name", "code"), FORMATS)
def test_kernels_count_like_the_oracle_on_every_level(level: str, name: str, code: int) -> None:
    width = R.NONFINITE_SPECS[code][0]
    kind = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(name)
    with backend(level):
        for seed, n in enumerate(COUNTS):
            a, b = _values(code, n, seed), _values(code, n, seed + 100)
            want = R.count_nonfinite(a, code)
            for what, fn, expect in _kernel_runs(a, b, width, kind):
                t = K.NonFiniteTally(code)
                got = fn(t)
                assert (t.nan, t.inf) == want, (level, name, n, what)
                if expect is not None:  # counting never changes what a kernel writes
                    assert np.array_equal(got, expect), (level, name, n, what)


@pytest.mark.parametrize("level", LEVELS)
def test_a_delta_counts_the_values_not_their_xor(level: str) -> None:
    code = R.NONFINITE_FORMATS["float32"]
    a = np.ones(4096, np.float32)
    a[[3, 700]] = [np.nan, -np.inf]
    base = np.full(4096, np.float32(1.0))
    base[[9, 2000, 4095]] = np.float32(np.inf).view(np.uint32) ^ np.float32(1.0).view(
        np.uint32)  # a ^ base is Inf there, a itself is 1.0
    base_b = base.view(np.uint8)
    assert R.count_nonfinite(a.view(np.uint8) ^ base_b, code) != (1, 1)
    with backend(level):
        for fn in (lambda t: K.xor(a, base_b, tally=t),
                   lambda t: K.xor_group(a, base_b, 4, tally=t),
                   lambda t: K.exp_group(a, "fp32", base_b, tally=t)):
            t = K.NonFiniteTally(code)
            fn(t)
            assert (t.nan, t.inf) == (1, 1)


def test_tally_refuses_other_element_widths() -> None:
    t = K.NonFiniteTally.of("float32")
    assert t is not None and K.NonFiniteTally.of("int32") is None
    assert K.NonFiniteTally.of("bool") is None
    data = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="4-byte elements cannot count 2-byte"):
        K.group(data, 2, tally=t)
    with pytest.raises(ValueError, match="cannot count"):
        K.exp_group(data, "bf16", tally=t)
    with pytest.raises(ValueError, match="unknown non-finite format"):
        K.NonFiniteTally(99)


@pytest.mark.parametrize("level", ["numpy", LEVELS[-1]])
@pytest.mark.parametrize("grouping", [True, False])
@pytest.mark.parametrize(("name", "code"), FORMATS)
def test_encoded_chunks_carry_their_counts(level: str, grouping: bool, name: str,
                                           code: int) -> None:
    """Every transform the encoder picks (exponent planes, grouping, none; a delta or not),
    one chunk at a time and batched: each chunk's count is its own values' (once)."""
    params = CodecParams(byte_grouping=grouping)
    chunks = [_values(code, n, n) for n in (33, 1000, 5)]
    bases = [None, _values(code, 1000, 7), None]
    want = [R.count_nonfinite(c, code) for c in chunks]
    with backend(level):
        one = [encode_chunk(c, name, b, params).nonfinite for c, b in zip(chunks, bases,
                                                                            strict=True)]
        batched = [e.nonfinite for e in encode_chunks(list(zip(chunks, [name] * 3, bases,
                                                                strict=True)), params)]
    assert one == batched == want
    assert any(w != (0, 0) for w in want)


@pytest.mark.parametrize("level", LEVELS)
def test_count_after_visits_every_byte_in_order_and_counts_whole_elements(level: str) -> None:
    """The uncompressed blob's pass: a hash sees each run, then the run is counted."""
    code = R.NONFINITE_FORMATS["float64"]
    a = _values(code, 3001, 5)
    seen: list[bytes] = []
    with backend(level):
        t = K.count_nonfinite_after(a, K.NonFiniteTally(code), lambda run: seen.append(
            bytes(run)), run_bytes=1001)  # rounded down to whole 8-byte elements
    assert b"".join(seen) == a.tobytes() and {len(s) for s in seen[:-1]} == {1000}
    assert (t.nan, t.inf) == R.count_nonfinite(a, code) != (0, 0)


@pytest.mark.parametrize("dtype", [torch.complex32, torch.complex64, torch.complex128])
def test_complex_tensors_count_each_component(dtype: torch.dtype) -> None:
    """A complex element is two floats of the component's format: a NaN real part and an
    Inf imaginary part count one NaN and one Inf."""
    t = torch.zeros(33, dtype=torch.complex64)
    t[3] = complex(float("nan"), float("inf"))
    t[20] = complex(1.0, float("-inf"))
    raw = t.to(dtype).view(torch.uint8).numpy()
    tally = K.NonFiniteTally.of(str(dtype).removeprefix("torch."))
    assert tally is not None
    K.count_nonfinite(raw, tally)
    assert (tally.nan, tally.inf) == (1, 2)
    grouped = K.NonFiniteTally.of(str(dtype).removeprefix("torch."))
    assert grouped is not None
    K.group(raw, grouped.width, tally=grouped)
    assert (grouped.nan, grouped.inf) == (1, 2)
