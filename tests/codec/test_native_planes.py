"""The one-call native chunk coder (native/chunkenc.c) writes exactly the bytes of the
per-plane Python coder, chunk by chunk and in batches, for every kind of plane it decides on
(constant, rANS, Huffman-only deflate, raw, left to zstd) and at every size boundary."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mithril_async.codec import chunk as chunk_mod
from mithril_async.codec import compress_state_dict, decompress_state_dict, entropy, rans
from mithril_async.codec.chunk import (
    CodecParams,
    EncodedChunk,
    decode_chunk,
    encode_chunk,
    encode_chunks,
)
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.entropy import PlaneMethod
from mithril_async.errors import ShapeMismatch
from tests.codec._helpers import det_tensor, same_bits

pytestmark = pytest.mark.skipif(not entropy.NATIVE_PLANES,
                                reason="native chunk coder not built or coders not bound")

P = CodecParams()


def _per_plane(monkeypatch: pytest.MonkeyPatch, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with the native chunk coder switched off (the per-plane reference)."""
    with monkeypatch.context() as m:
        m.setattr(rans, "_env_ok", False)
        assert not rans.planes_available()
        return fn(*args)


def _same(a: EncodedChunk, b: EncodedChunk) -> None:
    assert a.meta == b.meta
    assert a.payload == b.payload


def _raw(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return tensor_bytes(t)[0]


def _cases() -> list[tuple[str, torch.Tensor]]:
    """Chunks whose planes take every path, around every size threshold (16-byte exponent
    transform minimum, 16 Ki small-plane deflate try, 256 Ki rANS blocks)."""
    rng = np.random.default_rng(7)
    out: list[tuple[str, torch.Tensor]] = []
    for dt in ("float32", "bfloat16", "float16", "float64"):
        for n in (1, 3, 4, 5, 64, 4096, 16384, 16385, 70000, 300000):
            out.append((f"{dt} normal {n}", det_tensor(dt, (n,), n)))
    out.append(("float32 const", torch.full((5000,), 1.0)))
    out.append(("bfloat16 ones-ish", (1 + 1e-3 * torch.from_numpy(
        rng.integers(0, 2, 40000).astype(np.float32))).to(torch.bfloat16)))
    out.append(("float32 random bits", torch.from_numpy(
        rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)).view(torch.float32)))
    out.append(("float32 sparse", torch.from_numpy(
        np.where(rng.random(30000) < 0.01, rng.standard_normal(30000), 0).astype(np.float32))))
    return out


CASES = _cases()


@pytest.mark.parametrize(("name", "t"), CASES, ids=[c[0] for c in CASES])
def test_native_chunk_bytes_equal_per_plane_coder(monkeypatch: pytest.MonkeyPatch, name: str,
                                                 t: torch.Tensor) -> None:
    src = _raw(t)
    base = _raw(t.flip(0).contiguous())
    for b in (None, base):
        got = encode_chunk(src, tensor_bytes(t)[1], b, P)
        want = _per_plane(monkeypatch, encode_chunk, src, tensor_bytes(t)[1], b, P)
        _same(got, want)
        out = np.empty(src.size, np.uint8)
        decode_chunk(got.payload, got.meta, b, out)
        assert np.array_equal(out, src)


def test_cases_exercise_every_plane_method() -> None:
    """The cases above really reach each decision of the native coder."""
    seen = {m for _, t in CASES for b in (None, _raw(t.flip(0).contiguous()))
            for m, _ in encode_chunk(_raw(t), tensor_bytes(t)[1], b, P).meta.planes}
    assert {PlaneMethod.RAW, PlaneMethod.CONST, PlaneMethod.RANS32, PlaneMethod.HUFF,
            PlaneMethod.ZSTD} <= seen


def test_batch_equals_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_chunks: float chunks in one native call, others (ints, bools) one by one, in
    order, deltas mixed in; same bytes as encode_chunk of each."""
    items: list[tuple[Any, str, Any]] = []
    for i, (_, t) in enumerate(CASES[:: 3]):
        src, dname, _ = tensor_bytes(t)
        items.append((src, dname, _raw(t.flip(0).contiguous()) if i % 2 else None))
    for dt in ("int32", "bool", "uint8"):
        t = det_tensor(dt, (777,), 3)
        items.append((_raw(t), dt, None))
    got = encode_chunks(items, P)
    want = _per_plane(monkeypatch, lambda: [encode_chunk(s, d, b, P) for s, d, b in items])
    assert len(got) == len(items)
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def test_without_native_zstd_low_entropy_planes_come_back_to_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With zstd unbound, the native coder leaves zstd-worthy planes to the per-plane coder
    (PLANE_PYTHON) and the chunk still comes out byte for byte the same."""
    calls: list[int] = []
    real = chunk_mod.encode_plane

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(chunk_mod, "encode_plane", counted)
    low = [t for name, t in CASES if "sparse" in name or "ones" in name]
    zstd_seen = False
    assert not rans.bind_zstd(0, 0, 0, 0, 0)
    try:
        for t in low:
            src, dname, _ = tensor_bytes(t)
            for b in (None, _raw(t.flip(0).contiguous())):
                want = _per_plane(monkeypatch, encode_chunk, src, dname, b, P)
                before = len(calls)
                got = encode_chunks([(src, dname, b)], P)[0]
                if PlaneMethod.ZSTD in {m for m, _ in want.meta.planes}:
                    assert len(calls) > before  # that plane really came back to Python
                    zstd_seen = True
                _same(got, want)
                _same(encode_chunk(src, dname, b, P), want)  # the one-chunk native path too
    finally:
        entropy._bind_zstd()
    assert zstd_seen
    calls.clear()
    for t in low:
        encode_chunks([(_raw(t), tensor_bytes(t)[1], None)], P)
    assert not calls  # zstd bound again: no plane is left to Python


def test_batch_refuses_a_base_of_another_size() -> None:
    src = _raw(det_tensor("float32", (64,), 1))
    with pytest.raises(ShapeMismatch, match="delta base has 128 bytes, chunk has 256"):
        encode_chunks([(src, "float32", src[:128])], P)


def test_state_dict_blob_identical_and_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A many-small-tensor state (batched) plus big ones: the same blob either way."""
    sd = {f"n{i}": det_tensor("bfloat16" if i % 2 else "float32", (i * 37 + 1,), i)
          for i in range(60)}
    sd["big"] = det_tensor("float32", (200_000,), 99)
    sd["steps"] = torch.arange(100, dtype=torch.int64)
    prev = {k: (v + 1 if v.is_floating_point() else v) for k, v in sd.items()}
    for p in (None, prev):
        for threads in (1, 2):
            blob = compress_state_dict(sd, previous=p, threads=threads, chunk_bytes=1 << 16)
            ref = _per_plane(monkeypatch, lambda p=p: compress_state_dict(
                sd, previous=p, threads=1, chunk_bytes=1 << 16))
            assert blob == ref
        out = decompress_state_dict(blob, previous=p)
        assert all(same_bits(out[k], v) for k, v in sd.items())


def test_without_native_rans_the_per_plane_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rans, "NATIVE", False)
    assert not rans.planes_available()
    t = det_tensor("float32", (3000,), 5)
    enc = encode_chunks([(_raw(t), "float32", None)], P)[0]
    assert PlaneMethod.RANS32 not in {m for m, _ in enc.meta.planes}
    out = np.empty(t.numel() * 4, np.uint8)
    decode_chunk(enc.payload, enc.meta, None, out)
    assert np.array_equal(out, _raw(t))
