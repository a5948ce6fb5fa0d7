"""encode_chunk/decode_chunk: transforms, plane coders, delta, checksums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mithril_async.codec import rans
from mithril_async.codec.chunk import (
    CodecParams,
    Transform,
    chunk_spans,
    decode_chunk,
    encode_chunk,
)
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.entropy import PlaneMethod
from mithril_async.errors import ChecksumMismatch, ConfigError, InvalidFormat
from tests.codec._helpers import TORCH_DTYPES, det_tensor


def _roundtrip(src: np.ndarray, name: str, base: np.ndarray | None, p: CodecParams) -> None:
    enc = encode_chunk(src, name, base, p)
    assert enc.meta.stored_size <= src.size + 1
    out = np.empty(src.size, np.uint8)
    decode_chunk(enc.payload, enc.meta, base, out)
    assert np.array_equal(out, src)


@pytest.mark.parametrize("name", TORCH_DTYPES)
@pytest.mark.parametrize("grouping", [True, False])
def test_chunk_roundtrip(name: str, grouping: bool) -> None:
    src, _, _ = tensor_bytes(det_tensor(name, (257,), seed=2))
    base, _, _ = tensor_bytes(det_tensor(name, (257,), seed=3))
    for p in (CodecParams(byte_grouping=grouping), CodecParams(entropy="zstd", level=1)):
        _roundtrip(src, name, None, p)
        _roundtrip(src, name, base, p)


def test_transforms_and_plane_choices() -> None:
    w = (torch.randn(1 << 16) * 0.02).bfloat16()
    enc = encode_chunk(tensor_bytes(w)[0], "bfloat16", None, CodecParams())
    assert enc.meta.transform == Transform.EXP_BF16
    want = PlaneMethod.RANS32 if rans.NATIVE_V2 else (
        PlaneMethod.RANS if rans.NATIVE else PlaneMethod.HUFF)
    assert [m for m, _ in enc.meta.planes] == [want, PlaneMethod.RAW]
    # fp32 copies of bf16 weights: the two low mantissa planes are constant (seed 004).
    f = w.float()
    enc = encode_chunk(tensor_bytes(f)[0], "float32", None, CodecParams())
    assert [m for m, _ in enc.meta.planes][2:] == [PlaneMethod.CONST, PlaneMethod.CONST]
    assert enc.meta.stored_size < f.numel() * 2 * 0.7


def test_incompressible_is_stored_raw_and_never_grows() -> None:
    src = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    for name in ("uint8", "float32", "int64"):
        enc = encode_chunk(src, name, None, CodecParams())
        assert all(m == PlaneMethod.RAW for m, _ in enc.meta.planes)
        assert enc.meta.stored_size == src.size


def test_checksums_catch_corruption() -> None:
    src, _, _ = tensor_bytes(det_tensor("float32", (999,), seed=4))
    enc = encode_chunk(src, "float32", None, CodecParams())
    bad = bytearray(enc.payload)
    bad[len(bad) // 2] ^= 4
    out = np.empty(src.size, np.uint8)
    with pytest.raises(ChecksumMismatch, match="blk7"):
        decode_chunk(bytes(bad), enc.meta, None, out, where="blk7")
    # Even when the payload check is skipped, wrong data is never returned.
    with pytest.raises(InvalidFormat):
        decode_chunk(bytes(bad), enc.meta, None, out, where="blk7", verify_payload=False)


def test_chunk_spans_and_params() -> None:
    assert chunk_spans(0, 4, 16) == []
    assert chunk_spans(40, 4, 18) == [(0, 16), (16, 16), (32, 8)]
    assert chunk_spans(6, 2, 1) == [(0, 2), (2, 2), (4, 2)]
    with pytest.raises(ValueError):
        chunk_spans(5, 2, 4)
    p = CodecParams(level=5, chunk_bytes=1 << 20)
    assert CodecParams.from_dict({**p.to_dict(), "future_knob": 1}) == p
    with pytest.raises(ConfigError):
        CodecParams(level=99)


def test_without_native_rans_deflate_is_written_and_rans_still_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = (torch.randn(3000) * 0.02).bfloat16()
    src = tensor_bytes(w)[0]
    enc = encode_chunk(src, "bfloat16", None, CodecParams())
    monkeypatch.setattr(rans, "NATIVE", False)
    out = np.empty(src.size, np.uint8)
    decode_chunk(enc.payload, enc.meta, None, out)  # pure-Python rANS decoder
    assert np.array_equal(out, src)
    enc2 = encode_chunk(src, "bfloat16", None, CodecParams())
    assert enc2.meta.planes[0][0] == PlaneMethod.HUFF
    decode_chunk(enc2.payload, enc2.meta, None, out)
    assert np.array_equal(out, src)


@pytest.mark.skipif(not rans.NATIVE_V2, reason="native rANS coder v2 not built")
def test_rans_output_buffer_sized_by_the_limit() -> None:
    """Below the plane's size a limit shrinks the coder's buffer (~limit, not 2x the plane)."""
    x = (np.random.default_rng(6).geometric(0.3, 6 << 20) % 256).astype(np.uint8)
    enc = rans.encode(x, 1 << 40)
    assert enc and len(enc) < x.size // 2
    limit = len(enc) * 101 // 100
    cap = int(rans._lib.mr2_encode_cap(x.size, limit))
    assert cap < int(rans._lib.mr2_encode_bound(x.size)) // 2
    assert rans.encode(x, limit) == enc
    assert rans.encode(x, len(enc)) == b""
    out = np.empty_like(x)
    rans.decode(enc, out, where="p")
    assert np.array_equal(out, x)


@pytest.mark.skipif(not rans.NATIVE, reason="native rANS coder not built")
@pytest.mark.parametrize("version", [1, 2])
def test_rans_native_and_python_decoders_agree_and_reject_garbage(version: int) -> None:
    if version == 2 and not rans.NATIVE_V2:
        pytest.skip("native coder predates format v2")
    rng = np.random.default_rng(5)
    for n in (1, 3, 4, 5, 31, 32, 33, 1000, (1 << 18) + 5, (1 << 18) + 32):
        x = (rng.geometric(0.4, n) % 256).astype(np.uint8)
        enc = rans.encode(x, 1 << 40, version=version)
        assert enc and rans.format_of(enc) == version
        levels = [0, -1] if version == 2 else [-1]  # scalar and the best SIMD coder
        try:
            for level in levels:  # the SIMD encoder writes the scalar one's bytes
                rans.set_level(level)
                assert rans.encode(x, 1 << 40, version=version) == enc
            for native, level in [(True, lv) for lv in levels] + [(False, -1)]:
                if not native and n > 5000:
                    continue
                rans.set_level(level)
                out = np.empty(n, np.uint8)
                rans.decode(enc, out, where="p", native=native, version=version)
                assert np.array_equal(out, x)
        finally:
            rans.set_level(-1)
        with pytest.raises(InvalidFormat):  # a plane method promising the other layout
            rans.decode(enc, np.empty(n, np.uint8), where="p", version=3 - version)
        # a limit a little above the coded size gives the same bytes (the coder's early exit
        # works on an estimate); at the coded size it gives up
        assert rans.encode(x, len(enc) * 101 // 100 + 512, version=version) == enc
        assert rans.encode(x, len(enc), version=version) == b""
        for pos in rng.integers(0, len(enc), 30):
            bad = bytearray(enc)
            bad[pos] ^= 1 << int(rng.integers(8))
            out = np.empty(n, np.uint8)
            try:
                rans.decode(bytes(bad), out, where="p")
            except InvalidFormat:
                continue
        with pytest.raises(InvalidFormat):
            rans.decode(enc[:-1], np.empty(n, np.uint8), where="p")
        with pytest.raises(InvalidFormat):
            rans.decode(enc, np.empty(n + 1, np.uint8), where="p")
    assert rans.encode(rng.integers(0, 256, 5000, dtype=np.uint8), 5000) == b""


@pytest.mark.skipif(not rans.NATIVE, reason="native rANS coder not built")
@pytest.mark.parametrize("n", [0, 1, 7, 16384, 16385, 50_001, 1 << 20])
def test_native_sampled_entropy_matches_the_numpy_reference(n: int) -> None:
    from mithril_async.codec.entropy import sample_entropy, sample_entropy_py

    rng = np.random.default_rng(n)
    skewed = np.minimum(rng.geometric(0.3, n), 255).astype(np.uint8)
    for plane in (skewed, rng.integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8)):
        native = rans.sample_entropy(plane, 16384)
        assert native is not None
        assert native == pytest.approx(sample_entropy_py(plane), abs=1e-9)
        assert sample_entropy(plane) == native
    if n > 2:  # a strided view is not handed to C: the reference answers
        view = skewed[::2]
        assert sample_entropy(view) == pytest.approx(sample_entropy_py(view), abs=1e-12)


@pytest.mark.skipif(not rans.NATIVE_V2, reason="native rANS coder v2 not built")
def test_rans_v2_every_simd_level_writes_the_scalar_coders_bytes() -> None:
    """The AVX2 and AVX-512 encoders (the latter codes two blocks at once) are exact
    re-implementations of the scalar one: same bytes for any length (partial rounds, partial
    last blocks, odd and even block counts) and distribution, and the same early give-up."""
    top = rans.set_level(-1)
    B = 1 << 18
    rng = np.random.default_rng(11)
    dists = {
        "geometric": lambda n: (rng.geometric(0.35, n) % 256).astype(np.uint8),
        "uniform": lambda n: rng.integers(0, 256, n, dtype=np.uint8),
        "two symbols": lambda n: np.where(rng.random(n) < 0.999, 7, 200).astype(np.uint8),
        "one symbol": lambda n: np.full(n, 131, np.uint8),
    }
    try:
        for n in (1, 31, 33, 64, 1000, B, B + 5, 2 * B, 2 * B + 17, 3 * B + 64, 5 * B):
            for dname, make in dists.items():
                x = make(n)
                rans.set_level(0)
                want = rans.encode(x, 1 << 40)
                assert want and rans.format_of(want) == 2
                gave_up = rans.encode(x, len(want) * 3 // 4)
                for level in range(1, top + 1):
                    assert rans.set_level(level) == level
                    assert rans.encode(x, 1 << 40) == want, (n, dname, level)
                    assert rans.encode(x, len(want) * 3 // 4) == gave_up == b""
                out = np.empty(n, np.uint8)
                rans.decode(want, out, where="p")
                assert np.array_equal(out, x), (n, dname)
    finally:
        rans.set_level(-1)


@pytest.mark.skipif(not rans.NATIVE, reason="native rANS coder not built")
def test_native_histogram_is_exact_at_every_simd_level() -> None:
    """The AVX-512 histogram counts a sampled top 16 by compare+popcount and the rest one by
    one; whatever the sample picks (or misses), the counts equal numpy's."""
    top = rans.set_level(-1)
    rng = np.random.default_rng(21)
    ffi, lib = rans._ffi, rans._lib
    peaked = (120 + rng.geometric(0.5, 300_000) % 20).astype(np.uint8)
    peaked[rng.integers(0, peaked.size, 500)] = rng.integers(0, 256, 500)  # rare others
    planes = {
        "peaked + rare others": peaked,
        "uniform (sample coverage < 90 %)": rng.integers(0, 256, 100_000, dtype=np.uint8),
        "one value": np.full(70_001, 9, np.uint8),
        "17 values": rng.integers(0, 17, 65_600, dtype=np.uint8),
        "others only at the tail": np.concatenate([np.full(8192, 1, np.uint8),
                                                    np.arange(63, dtype=np.uint8)]),
        "short": rng.integers(0, 4, 8191, dtype=np.uint8),
    }
    try:
        for level in range(top + 1):
            rans.set_level(level)
            for name, x in planes.items():
                hist = np.zeros(256, np.uint32)
                lib.mr_histogram(ffi.from_buffer("uint8_t[]", x), x.size,
                                 ffi.from_buffer("uint32_t[]", hist, require_writable=True))
                assert np.array_equal(hist, np.bincount(x, minlength=256)), (level, name)
    finally:
        rans.set_level(-1)
