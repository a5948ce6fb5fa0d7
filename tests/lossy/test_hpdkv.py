"""HPΔKV v1: roundtrips, exact byte layout, and malformed blobs raising only typed errors."""

from __future__ import annotations

import contextlib
import math
import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mithril_async.errors import InvalidFormat, UnknownFormatVersion, UnsupportedDtype
from mithril_async.lossy.hpdkv import (
    estimate_hpdkv_size,
    header_size,
    pack_residuals,
    unpack_residuals,
)

DTYPES = [torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (5, 6), (2, 3, 4, 5), (1,) * 9])
def test_dense_roundtrip_bit_exact(dtype: torch.dtype, compress: bool, shape: tuple[int, ...]
                                   ) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    blob = pack_residuals(t, compress=compress)
    out = unpack_residuals(blob)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(_bits(out), _bits(t))
    if not compress:
        assert len(blob) == estimate_hpdkv_size(shape)
    assert len(blob) <= estimate_hpdkv_size(shape, compress=compress)


def test_special_values_survive() -> None:
    t = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 6.1e-5, 65504.0],
                     dtype=torch.float16)
    assert torch.equal(_bits(unpack_residuals(pack_residuals(t))), _bits(t))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.25, 1.0])
def test_topk_keeps_largest(dtype: torch.dtype, compress: bool, frac: float) -> None:
    t = torch.randn(40, 25, generator=torch.Generator().manual_seed(1)).to(dtype)
    blob = pack_residuals(t, store_topk=frac, compress=compress)
    out = unpack_residuals(blob)
    k = int(torch.count_nonzero(out))
    assert k == math.ceil(frac * 1000)
    kept = out != 0
    assert torch.equal(out[kept], t[kept])
    if 0 < k < 1000:
        assert t[kept].float().abs().min() >= t[~kept].float().abs().max()
    size = estimate_hpdkv_size(t.shape, store_topk=frac, compress=compress)
    assert len(blob) == size if not compress else len(blob) <= size


def test_topk_large_rank_and_scores() -> None:
    t = torch.randn(2, 1, 3, 1, 2, 1, 2, 1, 1, 2, 1, 2).to(torch.float16)
    scores = torch.arange(t.numel(), dtype=torch.float32)  # rank by position, not magnitude
    out = unpack_residuals(pack_residuals(t, store_topk=0.5, scores=scores))
    half = t.numel() // 2
    assert torch.equal(_bits(out.reshape(-1)[half:]), _bits(t.reshape(-1)[half:]))
    assert torch.count_nonzero(out.reshape(-1)[:half]) == 0


def test_byte_layout_dense() -> None:
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    blob = pack_residuals(t)
    assert blob[:4] == b"HPDV"
    assert blob[4] == 1 and blob[5] == 0 and blob[6] == 2 and blob[7] == 0
    assert struct.unpack_from("<2I", blob, 8) == (2, 3)
    assert blob[16:] == t.numpy().astype("<f2").tobytes()
    assert header_size(2) == 16 and len(blob) == 16 + 12


def test_byte_layout_sparse_compressed_bf16() -> None:
    t = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    t[1, 1, 2] = 5.0
    t[2, 0, 0] = -7.0
    blob = pack_residuals(t, store_topk=2 / 24, compress=True)
    assert blob[4:8] == bytes([1, 1, 3, 0b11])
    assert struct.unpack_from("<3I", blob, 8) == (3, 2, 4)
    assert blob[20:32] == b"\x00" * 12  # 8 + 12 header bytes padded to 32
    assert struct.unpack_from("<3I", blob, 32) == (2, 14, 16)
    payload = zlib.decompress(blob[44:])
    assert payload == t.reshape(-1)[[14, 16]].view(torch.int16).numpy().astype("<i2").tobytes()


def test_padding_sizes() -> None:
    assert [header_size(r) for r in (0, 1, 2, 3, 4, 5, 255)] == [16, 16, 16, 32, 32, 32, 1040]


def test_writer_refuses_bad_input() -> None:
    with pytest.raises(UnsupportedDtype):
        pack_residuals(torch.zeros(3))
    with pytest.raises(ValueError):
        pack_residuals(torch.zeros(3, dtype=torch.float16), store_topk=1.5)


def _valid_blobs() -> list[bytes]:
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    return [pack_residuals(t), pack_residuals(t, compress=True),
            pack_residuals(t.to(torch.bfloat16), store_topk=0.3),
            pack_residuals(t, store_topk=0.5, compress=True)]


@pytest.mark.parametrize("blob", _valid_blobs())
def test_every_truncation_and_extension_is_typed(blob: bytes) -> None:
    for cut in range(len(blob)):
        with pytest.raises(InvalidFormat):
            unpack_residuals(blob[:cut])
    with pytest.raises(InvalidFormat):
        unpack_residuals(blob + b"\x00")


def test_version_magic_dtype_flags_padding() -> None:
    blob = bytearray(_valid_blobs()[0])
    for off, val, err in [(4, 2, UnknownFormatVersion), (4, 0, UnknownFormatVersion),
                          (0, ord("X"), InvalidFormat), (5, 2, InvalidFormat),
                          (7, 0x04, InvalidFormat), (12, 1, InvalidFormat)]:
        bad = bytearray(blob)
        bad[off] = val
        with pytest.raises(err):
            unpack_residuals(bytes(bad))


def test_no_allocation_from_unvalidated_shape() -> None:
    head = b"HPDV" + bytes([1, 0, 2, 1]) + struct.pack("<2I", 0xFFFFFFFF, 0xFFFFFFFF)
    with pytest.raises(InvalidFormat):  # sparse, k = 0, shape of 2**64 elements
        unpack_residuals(head + struct.pack("<I", 0))
    head = b"HPDV" + bytes([1, 0, 1, 2]) + struct.pack("<I", 10**9) + b"\x00" * 4
    with pytest.raises(InvalidFormat):  # zlib payload that cannot inflate to 2 GB
        unpack_residuals(head + zlib.compress(b"\x00" * 100))
    with pytest.raises(InvalidFormat):  # bomb: inflates past the declared size, bounded
        unpack_residuals(b"HPDV" + bytes([1, 0, 1, 2]) + struct.pack("<I", 8) + b"\x00" * 4
                         + zlib.compress(b"\x00" * 10**6))
    with pytest.raises(InvalidFormat):  # sparse indices not increasing
        unpack_residuals(b"HPDV" + bytes([1, 0, 1, 1]) + struct.pack("<I", 8) + b"\x00" * 4
                         + struct.pack("<3I", 2, 5, 5) + b"\x00" * 4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_blobs(data: bytes) -> None:
    for blob in (data, b"HPDV\x01" + data):
        with contextlib.suppress(InvalidFormat):
            unpack_residuals(blob)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_valid_blobs()), st.lists(st.tuples(st.integers(0, 10**6),
                                                           st.integers(0, 255)), max_size=4),
       st.integers(0, 300))
def test_fuzz_mutated_blobs(blob: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    bad = bytearray(blob)
    for pos, val in edits:
        bad[pos % len(bad)] = val
    with contextlib.suppress(InvalidFormat):
        unpack_residuals(bytes(bad[: len(bad) - cut % 8]))
