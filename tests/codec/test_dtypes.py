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
