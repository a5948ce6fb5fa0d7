"""DistCoordinator pieces that need no second process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mithril_async.distributed import DistCoordinator, dist_world
from mithril_async.errors import DistributedError
from mithril_async.sharded import from_local, to_local


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


_DTENSOR_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from mithril_async.sharded import from_local, to_local
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
tree = {"w": w, "step": torch.tensor(3), "nested": [w * 2]}
local = to_local(tree)
assert type(local["w"]) is torch.Tensor and not local["w"].requires_grad
assert torch.equal(local["w"], w.to_local())
assert local["w"].data_ptr() == w.to_local().data_ptr()  # a view of the shard, not a copy
assert torch.equal(local["nested"][0], (w * 2).to_local())
back = from_local({k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in local.items()}, tree)
assert torch.equal(back["w"].full_tensor(), w.full_tensor())
dist.destroy_process_group()
print("ok")
"""


def test_dtensor_shards_are_read_without_autograd(tmp_path: Path) -> None:
    """to_local() reads a DTensor's shard directly (detached view, no copy), in a separate
    process so no process group is left behind here."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT, f"{tmp_path}/store"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_sharded_names_moved_and_the_old_path_warns() -> None:
    """ShardedModel & co. live in mithril_async.sharded; mithril_async.distributed still
    gives them for a release, with a DeprecationWarning naming the new path."""
    import mithril_async.distributed as old
    import mithril_async.sharded as new

    with pytest.warns(DeprecationWarning, match=r"mithril_async\.sharded\.ShardedModel"):
        got = old.ShardedModel
    assert got is new.ShardedModel
    with pytest.raises(AttributeError, match="no_such_name"):
        old.no_such_name  # noqa: B018
