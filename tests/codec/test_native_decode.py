"""The one-call native chunk decoder (native/chunkenc.c: mc_decode_chunk) gives exactly the
bytes of the per-plane Python decoder, for every transform it inverts (none, byte grouping,
both exponent layouts, with a delta base), every plane method it decodes (raw, constant,
rANS), a tail plane, and at every kernel level; and it fails as the Python decoder does, with
the same typed errors and messages: a damaged payload, wrong decoded bytes, a corrupt rANS
plane, planes that do not fit the transform."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from mithril_async.codec import chunk as chunk_mod
from mithril_async.codec import kernels, rans
from mithril_async.codec.chunk import ChunkMeta, CodecParams, decode_chunk, encode_chunk
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.entropy import PlaneMethod
from mithril_async.codec.transforms import Transform
from mithril_async.errors import ChecksumMismatch, InvalidFormat
from tests.codec._helpers import det_tensor

pytestmark = pytest.mark.skipif(not chunk_mod._NATIVE_DECODER or not rans.decoder_available(),
                                reason="native chunk decoder not built or not bound")

P = CodecParams()
U8 = np.ndarray[Any, np.dtype[np.uint8]]


def _cases() -> list[tuple[str, U8, str]]:
    """(name, raw bytes, dtype): chunks whose planes take every native path."""
    rng = np.random.default_rng(3)
    out: list[tuple[str, U8, str]] = []
    for dt in ("float32", "bfloat16", "float16", "float64", "int8", "int32", "complex64"):
        for n in (1, 5, 4096, 70000, 300000):
            raw, name, _ = tensor_bytes(det_tensor(dt, (n,), n))
            out.append((f"{dt} {n}", raw, name))
    out.append(("float32 const", tensor_bytes(torch.full((5000,), 1.5))[0], "float32"))
    zeros = np.zeros(9000, np.uint8)
    out.append(("uint8 zeros", zeros, "uint8"))
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    out.append(("float32 random bits", bits.view(np.uint8), "float32"))
    # a grouped chunk that is not a whole number of elements: a tail plane
    out.append(("float16 odd bytes", rng.standard_normal(4001).astype(np.float16)
                .view(np.uint8)[:8001].copy(), "float16"))
    return out


CASES = _cases()


def _python(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args)`` with the native chunk decoder switched off: the per-plane reference."""
    saved = chunk_mod._NATIVE_DECODER
    chunk_mod._NATIVE_DECODER = False
    try:
        return fn(*args, **kw)
    finally:
        chunk_mod._NATIVE_DECODER = saved


def _payload(enc: Any) -> bytes:
    return b"".join(bytes(p) for p in enc.parts)


def _native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Codes returned by the native decoder from here on."""
    codes: list[int] = []
    real = rans.decode_chunk_native

    def counted(*args: Any, **kw: Any) -> tuple[int, int, int]:
        got = real(*args, **kw)
        codes.append(got[0])
        return got

    monkeypatch.setattr(rans, "decode_chunk_native", counted)
    return codes


@pytest.fixture(params=[lvl for lvl in kernels.LEVELS
                        if lvl in kernels.available_backends()])
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    kernels.set_backend(request.param)
    try:
        yield request.param
    finally:
        kernels.set_backend(None)


@pytest.mark.parametrize(("name", "raw", "dtype"), CASES, ids=[c[0] for c in CASES])
def test_native_decode_equals_the_per_plane_decoder(monkeypatch: pytest.MonkeyPatch,
                                                    level: str, name: str, raw: U8,
                                                    dtype: str) -> None:
    base = raw[::-1].copy()
    for b in (None, base):
        enc = encode_chunk(raw, dtype, b, P)
        payload = _payload(enc)
        want = np.empty(raw.size, np.uint8)
        _python(decode_chunk, payload, enc.meta, b, want)
        assert np.array_equal(want, raw)
        codes = _native_calls(monkeypatch)
        got = np.full(raw.size, 0xA5, np.uint8)
        decode_chunk(payload, enc.meta, b, got)
        assert np.array_equal(got, raw), (name, b is not None)
        # the native call took every chunk whose planes and transform it decodes
        tr = Transform(enc.meta.transform & 0x7F)
        native_methods = {PlaneMethod.RAW, PlaneMethod.CONST, PlaneMethod.RANS32}
        takes = (all(m in native_methods for m, _ in enc.meta.planes)
                 and not (tr == Transform.NONE and b is not None))
        assert codes == ([rans.DEC_OK] if takes else []), (name, enc.meta.planes)
        monkeypatch.undo()


def test_every_native_path_is_exercised() -> None:
    """The cases above reach each transform the native decoder inverts, each plane method
    it decodes, and a tail plane (so a silently skipped native path would show)."""
    seen_tr, seen_m, tail = set(), set(), False
    for _name, raw, dtype in CASES:
        meta = encode_chunk(raw, dtype, None, P).meta
        seen_tr.add(Transform(meta.transform & 0x7F))
        seen_m |= {m for m, _ in meta.planes}
        tail |= len(meta.planes) > max(1, meta.width)
    assert seen_tr == set(Transform)
    assert {PlaneMethod.RAW, PlaneMethod.CONST, PlaneMethod.RANS32} <= seen_m
    assert tail


def _rans_chunk() -> tuple[ChunkMeta, bytearray, U8]:
    raw, name, _ = tensor_bytes(det_tensor("float32", (70000,), 9))
    enc = encode_chunk(raw, name, None, P)
    assert any(m == PlaneMethod.RANS32 for m, _ in enc.meta.planes)
    return enc.meta, bytearray(_payload(enc)), raw


def _same_error(call: Any) -> BaseException:
    """The error ``call()`` raises natively, checked equal to the per-plane decoder's."""
    with pytest.raises((ChecksumMismatch, InvalidFormat)) as native:
        call()
    with pytest.raises((ChecksumMismatch, InvalidFormat)) as python:
        _python(call)
    assert type(native.value) is type(python.value)
    assert str(native.value) == str(python.value)
    return native.value


def test_a_damaged_payload_fails_as_in_python() -> None:
    meta, payload, raw = _rans_chunk()
    payload[len(payload) // 2] ^= 0x10
    out = np.empty(raw.size, np.uint8)
    err = _same_error(lambda: decode_chunk(bytes(payload), meta, None, out, where="c0"))
    assert isinstance(err, ChecksumMismatch) and "stored payload" in str(err)
    assert err.expected == meta.payload_xxh64


def test_a_corrupt_rans_plane_fails_as_in_python() -> None:
    """Payload hash not checked (a caller that checked it whole): the rANS decoder itself
    finds the damage; the per-plane path names it."""
    meta, payload, raw = _rans_chunk()
    payload[40] ^= 0xFF  # inside the first (rANS) plane's frequency table / states
    out = np.empty(raw.size, np.uint8)
    err = _same_error(lambda: decode_chunk(bytes(payload), meta, None, out, where="c0",
                                           verify_payload=False))
    assert "c0 plane 0" in str(err)


def test_wrong_decoded_bytes_fail_as_in_python() -> None:
    meta, payload, raw = _rans_chunk()
    bad = dataclasses.replace(meta, raw_xxh64=meta.raw_xxh64 ^ 1)
    out = np.empty(raw.size, np.uint8)
    err = _same_error(lambda: decode_chunk(bytes(payload), bad, None, out, where="c0"))
    assert isinstance(err, ChecksumMismatch) and "decoded bytes" in str(err)


def test_planes_that_do_not_fit_fail_as_in_python() -> None:
    """A raw plane of the wrong length and a constant plane of two bytes (the lengths still
    adding up to the payload): the native call declines, the per-plane path names them."""
    raw, name, _ = tensor_bytes(det_tensor("float32", (4096,), 2))
    enc = encode_chunk(raw, name, None, P)
    planes = list(enc.meta.planes)
    i = next(k for k, (m, _) in enumerate(planes) if m == PlaneMethod.RAW)
    j = next(k for k, (m, n) in enumerate(planes) if k != i and n > 2)
    moved = dataclasses.replace(enc.meta, planes=tuple(
        (m, n - 1 if k == i else n + 1 if k == j else n) for k, (m, n) in enumerate(planes)))
    out = np.empty(raw.size, np.uint8)
    err = _same_error(lambda: decode_chunk(_payload(enc), moved, None, out, where="c1",
                                           verify_payload=False))
    assert "raw plane holds" in str(err) or "plane" in str(err)
    const = dataclasses.replace(enc.meta, planes=tuple(
        (PlaneMethod.CONST if k == i else m, n) for k, (m, n) in enumerate(planes)))
    err = _same_error(lambda: decode_chunk(_payload(enc), const, None, out, where="c1",
                                           verify_payload=False))
    assert "constant plane" in str(err)
