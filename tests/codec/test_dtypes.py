"""dtype names, zero-copy views and their refusal of what has no fixed-width layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mithril_async.codec.dtypes import DTYPES, dtype_name, tensor_bytes, tensor_from_bytes
from mithril_async.errors import ShapeMismatch, UnsupportedDtype
from tests.codec._helpers import TORCH_DTYPES, det_tensor, same_bits


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_roundtrip_every_dtype(name: str) -> None:
    t = det_tensor(name, (3, 5), seed=1)
    buf, dn, shape = tensor_bytes(t)
    assert dn == name and shape == (3, 5) and buf.size == 15 * DTYPES[name].itemsize
    assert same_bits(tensor_from_bytes(buf.copy(), dn, shape), t)


def test_zero_copy_and_read_only() -> None:
    t = torch.arange(10, dtype=torch.float32)
    buf, _, _ = tensor_bytes(t)
    assert not buf.flags.writeable
    t[0] = 42.0  # the view shares memory: no copy was made
    assert buf[:4].view(np.float32)[0] == 42.0


def test_non_contiguous_and_conj_are_copied_not_mutated() -> None:
    t = torch.randn(4, 6)
    before = t.clone()
    nc = t.t()[1:, ::2]
    buf, _, shape = tensor_bytes(nc)
    assert shape == tuple(nc.shape)
    assert torch.equal(tensor_from_bytes(buf, "float32", shape), nc.contiguous())
    assert torch.equal(t, before)
    c = torch.randn(3, dtype=torch.complex64).conj()
    buf, _, _ = tensor_bytes(c)
    assert torch.equal(tensor_from_bytes(buf, "complex64", (3,)), c.resolve_conj())


def test_numpy_and_scalars_and_empty() -> None:
    a = np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::2]
    buf, name, shape = tensor_bytes(a)
    assert name == "int16" and shape == (2, 2)
    assert torch.equal(tensor_from_bytes(buf, name, shape), torch.from_numpy(a.copy()))
    for t in (torch.tensor(3.5), torch.empty(0, 4, dtype=torch.bfloat16)):
        buf, name, shape = tensor_bytes(t)
        assert same_bits(tensor_from_bytes(buf, name, shape), t)


def test_unsupported_dtypes_name_the_tensor() -> None:
    with pytest.raises(UnsupportedDtype, match=r"my\.sparse"):
        tensor_bytes(torch.eye(3).to_sparse(), where="my.sparse")
    with pytest.raises(UnsupportedDtype, match="obj"):
        tensor_bytes(np.array(["a"], dtype=object), where="obj")
    with pytest.raises(UnsupportedDtype):
        dtype_name(np.dtype(">f4"))
    with pytest.raises(UnsupportedDtype, match="nope"):
        tensor_from_bytes(b"", "nope", ())
    with pytest.raises(ShapeMismatch):
        tensor_from_bytes(np.zeros(3, np.uint8), "float32", (1,))


ML_SHARED = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "float8_e8m0fnu"]


@pytest.mark.parametrize("name", ML_SHARED)
def test_ml_dtypes_arrays_are_torchs_dtype_of_the_same_name(name: str) -> None:
    """JAX's numpy dtypes (ml_dtypes) reach the codec without torch, as the same bytes under
    the same name; the torch tensor decoded from them holds the same values."""
    ml = pytest.importorskip("ml_dtypes")
    values = np.linspace(0.25 if name == "float8_e8m0fnu" else -3.0, 3.0, 12, dtype=np.float32)
    a = values.astype(getattr(ml, name)).reshape(3, 4)
    buf, dn, shape = tensor_bytes(a)
    assert (dn, shape) == (name, (3, 4)) and dtype_name(a.dtype) == name
    t = tensor_from_bytes(buf.copy(), dn, shape)
    assert t.dtype == DTYPES[name].torch_dtype
    assert same_bits(t, torch.from_numpy(values).reshape(3, 4).to(t.dtype))
    assert DTYPES[name].numpy_dtype == a.dtype


def test_float8_kinds_only_ml_dtypes_has_decode_to_numpy_not_torch() -> None:
    ml = pytest.importorskip("ml_dtypes")
    from mithril_async.codec.state_dict import compress_state_dict, decompress_state_dict

    for name in ("float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz"):
        a = np.linspace(-2, 2, 10, dtype=np.float32).astype(getattr(ml, name))
        assert dtype_name(a) == name and DTYPES[name].torch_dtype is None
        out = decompress_state_dict(compress_state_dict({"a": a}), as_numpy=True)["a"]
        assert out.dtype == a.dtype and np.array_equal(out.view(np.uint8), a.view(np.uint8))
        with pytest.raises(UnsupportedDtype, match="no torch equivalent"):
            tensor_from_bytes(a.view(np.uint8), name, (10,))
    with pytest.raises(UnsupportedDtype, match="int4"):  # one value per byte here, packed in torch
        dtype_name(np.zeros(2, ml.int4))
