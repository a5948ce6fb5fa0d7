"""Shared helpers of the codec tests: bitwise tensor comparison, deterministic tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mithril_async.codec.dtypes import DTYPES, tensor_bytes

TORCH_DTYPES = [n for n, i in DTYPES.items() if i.torch_dtype is not None]


def same_bits(a: Any, b: Any) -> bool:
    """Equal dtype name, shape and bytes (NaN payloads and -0.0 included)."""
    ab, an, ash = tensor_bytes(a)
    bb, bn, bsh = tensor_bytes(b)
    return an == bn and ash == bsh and np.array_equal(ab, bb)


def det_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A deterministic tensor of dtype ``name``: random bytes, floats made weight-like."""
    info = DTYPES[name]
    assert info.torch_dtype is not None
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    if name in ("float32", "float16", "bfloat16", "float64"):
        vals = rng.standard_normal(n).astype(np.float32) * 0.02
        t = torch.from_numpy(vals).to(info.torch_dtype)
    else:
        raw = rng.integers(0, 256, n * info.itemsize, dtype=np.uint8)
        if name == "bool":
            raw &= 1
        t = torch.from_numpy(raw.copy()).view(info.torch_dtype) if n else torch.empty(
            0, dtype=info.torch_dtype)
    return t.reshape(shape)
