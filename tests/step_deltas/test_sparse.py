"""The bitwise diff and the on-disk form of one sparse delta."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mithril_async.errors import InvalidFormat, UnknownFormatVersion, UnsupportedDtype
from mithril_async.step_deltas.sparse import (
    SparseLayerDelta,
    decode_delta,
    delta_to_tensors,
    diff_tensor,
    encode_delta,
    encode_tensors,
    load_sparse_delta,
    tensors_to_delta,
)


def test_diff_is_bitwise() -> None:
    prev = torch.tensor([0.0, 1.0, float("nan"), 2.0, -0.0], dtype=torch.float32)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.5, -0.0], dtype=torch.float32)
    # -0.0 vs 0.0 compare equal as floats but are different bits; NaN == NaN bitwise here
    assert diff_tensor(prev, new).tolist() == [0, 3]
    with pytest.raises(UnsupportedDtype):
        diff_tensor(prev.int(), new.int())


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.integers(0, 2**31 - 1),
)
def test_scatter_of_new_values_is_exact(xs: list[float], dtype: torch.dtype, seed: int) -> None:
    prev = torch.tensor(xs, dtype=torch.float32).to(dtype)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(xs), generator=g) * (torch.rand(len(xs), generator=g) < 0.3)
    new = (prev.float() + noise).to(dtype)
    idx = diff_tensor(prev, new)
    d = SparseLayerDelta((len(xs),), idx, new[idx], prev[idx])
    step, layers = decode_delta(encode_delta(7, {"w": d}))
    assert step == 7
    got = prev.clone()
    layers["w"].apply_(got)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), new.view(bits))


def test_roundtrip_and_dense_view(tmp_path: Path) -> None:
    d = SparseLayerDelta(
        (2, 3),
        torch.tensor([1, 5]),
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        torch.tensor([1.0, 0.0], dtype=torch.bfloat16),
    )
    tensors = delta_to_tensors(3, {"layer.0.weight": d})
    assert tensors["layer.0.weight.indices"].dtype == torch.int32  # small layers: int32
    path = tmp_path / "delta_000003.mckp"
    path.write_bytes(encode_delta(3, {"layer.0.weight": d}))
    dense = load_sparse_delta(path)
    assert dense["layer.0.weight"].tolist() == [[0.0, 0.5, 0.0], [0.0, 0.0, -2.0]]
    coo = load_sparse_delta(path, dense=False)["layer.0.weight"]
    assert coo.shape == (2, 3) and coo.indices.dtype == torch.int64
    assert coo.indices.tolist() == [1, 5] and coo.values.dtype == torch.bfloat16


def test_refuses_bad_blobs() -> None:
    good = delta_to_tensors(1, {})
    with pytest.raises(UnknownFormatVersion):
        tensors_to_delta({**good, "__delta__.version": torch.tensor([99])})
    with pytest.raises(InvalidFormat, match="not a sparse delta"):
        tensors_to_delta({"x.values": torch.zeros(1)})
    bad = delta_to_tensors(
        1, {"w": SparseLayerDelta((2,), torch.tensor([5]), torch.ones(1), torch.zeros(1))}
    )
    with pytest.raises(InvalidFormat, match="outside shape"):
        tensors_to_delta(bad)
    with pytest.raises(InvalidFormat):
        decode_delta(b"definitely not a blob", "x.mckp")
    blob = bytearray(encode_tensors(good))
    blob[-1] ^= 0xFF
    with pytest.raises(InvalidFormat):
        decode_delta(bytes(blob), "corrupt.mckp")
