"""DistCoordinator pieces that need no second process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mithril_async.distributed import DistCoordinator, dist_world, from_local, to_local
from mithril_async.errors import DistributedError


def test_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        pytest.skip("torch.distributed is initialised in this process")
    assert dist_world() is None
    with pytest.raises(DistributedError, match="init_process_group"):
        DistCoordinator()


def test_plain_trees_pass_through_unchanged() -> None:
    t = torch.arange(4.0)
    tree = {"a": t, "b": [t, 3, "x"], "c": (1.5, None)}
    assert to_local(tree)["a"] is t
    assert from_local(to_local(tree), tree) == tree
