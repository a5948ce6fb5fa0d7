"""State flattening round-trips real optimizer/scheduler state without pickle."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from mithril_async.errors import UnsupportedStateType
from mithril_async.state import capture_rng, flatten_state, restore_rng, unflatten_state


def _adamw_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return opt.state_dict()


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_optimizer_state_roundtrip_through_json() -> None:
    sd = _adamw_state()
    skeleton, tensors = flatten_state(sd)
    skeleton = json.loads(json.dumps(skeleton))  # must be plain JSON
    back = unflatten_state(skeleton, {k: v.clone() for k, v in tensors.items()})
    assert _equal(sd, back)
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert 0 in back["state"]  # int keys survive


def test_exotic_leaves_roundtrip() -> None:
    tree = {
        "nan": float("nan"), "inf": float("-inf"), "none": None, "b": True,
        "tup": (1, (2.5, "x")), "dtype": torch.bfloat16, "dev": torch.device("cpu"),
        "size": torch.Size([2, 3]), "np": np.arange(5, dtype=np.int16),
        "npscalar": np.float32(1.5), (1, 2): "tuple key", 3.5: "float key", b"k": None,
    }
    with pytest.raises(UnsupportedStateType, match="dict key of type bytes"):
        flatten_state(tree)
    del tree[b"k"]
    skeleton, tensors = flatten_state(tree)
    back = unflatten_state(json.loads(json.dumps(skeleton)), tensors)
    assert _equal(tree, back)


def test_unsupported_leaf_names_its_path() -> None:
    with pytest.raises(UnsupportedStateType, match=r"'a/b/1'"):
        flatten_state({"a": {"b": [1, object()]}})


def test_rng_capture_restore_replays_all_generators() -> None:
    state = json.loads(json.dumps(capture_rng()))
    first = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(7)
    restore_rng(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])
