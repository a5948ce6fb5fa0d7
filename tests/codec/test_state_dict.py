"""compress_state_dict/decompress_state_dict: bitwise roundtrips, delta, no mutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mithril_async.codec import compress_state_dict, decompress_state_dict, read_info
from mithril_async.codec.dtypes import DTYPES, tensor_bytes
from mithril_async.errors import MissingPrevious, UnsupportedDtype
from tests.codec._helpers import TORCH_DTYPES, det_tensor, same_bits

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    n = int(np.prod(shape, dtype=np.int64)) * DTYPES[name].itemsize
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
    if name == "bool":
        raw = raw & 1  # other byte values are not valid torch bools
    t = det_tensor(name, shape, 0)
    if n:
        t = torch.from_numpy(raw.copy()).view(DTYPES[name].torch_dtype).reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=st.dictionaries(st.text(min_size=1, max_size=8), tensors(), max_size=4),
       chunk=st.sampled_from([16, 64, 4096]), grouping=st.booleans(), delta=st.booleans())
def test_roundtrip_any_dtype_shape(sd: dict[str, torch.Tensor], chunk: int, grouping: bool,
                                   delta: bool) -> None:
    prev = {k: det_tensor(DTYPES_BY_TORCH[v.dtype], tuple(v.shape), 9) for k, v in sd.items()}
    snapshot = {k: tensor_bytes(v)[0].copy() for k, v in sd.items()}
    blob = compress_state_dict(sd, previous=prev if delta else None, chunk_bytes=chunk,
                               byte_grouping=grouping, threads=2)
    out = decompress_state_dict(blob, previous=prev if delta else None, threads=2)
    assert list(out) == list(sd)
    for k, v in sd.items():
        assert same_bits(out[k], v), k
        assert np.array_equal(tensor_bytes(v)[0], snapshot[k]), "input mutated"


DTYPES_BY_TORCH = {i.torch_dtype: n for n, i in DTYPES.items() if i.torch_dtype is not None}


def test_numpy_inputs_and_as_numpy() -> None:
    sd = {"a": np.arange(12, dtype=np.float32).reshape(3, 4).T, "b": torch.ones(2)}
    blob = compress_state_dict(sd)
    out = decompress_state_dict(blob)
    assert isinstance(out["a"], torch.Tensor) and same_bits(out["a"], sd["a"])
    out = decompress_state_dict(blob, as_numpy=True)
    assert isinstance(out["a"], np.ndarray) and np.array_equal(out["a"], sd["a"])
    assert isinstance(out["b"], torch.Tensor)


def test_input_never_mutated_even_with_delta() -> None:
    cur = {"w": torch.randn(1000), "b": torch.randn(64).bfloat16()}
    prev = {"w": torch.randn(1000), "b": torch.randn(64).bfloat16()}
    before = {k: v.clone() for k, v in cur.items()}
    pbefore = {k: v.clone() for k, v in prev.items()}
    compress_state_dict(cur, previous=prev, chunk_bytes=128)
    assert all(same_bits(cur[k], before[k]) and same_bits(prev[k], pbefore[k]) for k in cur)


def test_delta_shrinks_and_needs_the_right_base() -> None:
    prev = {"w": (torch.randn(1 << 15) * 0.02), "new": torch.ones(3), "shape": torch.ones(4)}
    cur = {"w": prev["w"] + 1e-6 * torch.randn(1 << 15), "new2": torch.zeros(2),
           "shape": torch.ones(5)}
    full = compress_state_dict(cur)
    delta = compress_state_dict(cur, previous=prev, step=2)
    assert len(delta) < len(full)
    info = read_info(delta)
    assert info.training_step == 2
    assert [t.base_xxh64 is not None for t in info.tensors] == [True, False, False]
    out = decompress_state_dict(delta, previous=prev)
    assert all(same_bits(out[k], v) for k, v in cur.items())
    with pytest.raises(MissingPrevious, match="'w'"):
        decompress_state_dict(delta)
    with pytest.raises(MissingPrevious, match="'w'"):
        decompress_state_dict(delta, previous={"w": prev["w"] + 1})
    with pytest.raises(MissingPrevious, match="'w'"):
        decompress_state_dict(delta, previous={"x": prev["w"]})


def test_unsupported_value_names_the_entry() -> None:
    with pytest.raises(UnsupportedDtype, match=r"bad\.entry"):
        compress_state_dict({"bad.entry": [1, 2, 3]})  # type: ignore[dict-item]
