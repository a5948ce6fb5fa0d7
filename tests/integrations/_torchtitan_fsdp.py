"""One rank of a torchtitan-style job whose model is sharded with FSDP2 (``fully_shard`` on a
CPU mesh, gloo), checkpointed through the mithril backend, launched as torchrun would.

    python _torchtitan_fsdp.py OUT_DIR save STEPS     # train STEPS steps, saving every 2
    python _torchtitan_fsdp.py OUT_DIR resume         # load the latest, train one more step

Each mode writes, on rank 0, the whole model and optimizer state (gathered, as plain
tensors, so two world sizes compare) to ``OUT_DIR/<mode>.pt``: after the last save for
``save``, right after the load (and the step it resumed) for ``resume``; ``resume`` then
trains and saves one more step at its own world size. The data loader is excluded from
loading on resume: torchtitan's cannot change its degree.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# the checkout under test first (this script runs as a file, not from the test package)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from mithril_async.integrations.torchtitan import MithrilCheckpointManager
from tests.integrations._torchtitan_train import Pairs, TrainState

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(out: str, resume: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2, fused=False).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=20)
    loader = ParallelAwareDataloader(Pairs(seed=1 + rank), dp_rank=rank, dp_world_size=world,
                                     batch_size=8, generator=torch.Generator().manual_seed(2))
    state = TrainState()
    ckpt = MithrilCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=2, keep_latest_k=0,
        last_save_model_only=False,
        exclude_from_loading=["dataloader"] if resume else [],
        mithril={"checkpointing": {"run_id": "fsdp", "compression": {"threads": 1}}})
    checkpointer = ckpt.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                              lr_schedulers=schedulers, states={"train_state": state},
                              sd_adapter=None, base_folder=out)
    return {"model": model, "optimizers": optimizers, "schedulers": schedulers,
            "loader": loader, "state": state, "checkpointer": checkpointer}


def step(parts: dict[str, Any], data: Any) -> None:
    state = parts["state"]
    state.step += 1
    x, y = next(data)
    nn.functional.mse_loss(parts["model"](x), y).backward()
    parts["checkpointer"].maybe_wait_for_staging()
    parts["optimizers"].step()
    parts["schedulers"].step()
    parts["optimizers"].zero_grad()
    parts["checkpointer"].save(state.step)


def dump(parts: dict[str, Any], out: str, name: str) -> None:
    model = parts["model"]
    full = {"model": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, parts["optimizers"].optimizers[0],
                                                  options=FULL),
            "step": parts["state"].step, "scheduler": parts["schedulers"].state_dict()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(out, f"{name}.pt"))


def main() -> None:
    dist.init_process_group("gloo")
    out, mode = sys.argv[1], sys.argv[2]
    try:
        parts = build(out, resume=mode == "resume")
        data = iter(parts["loader"])
        if mode == "save":
            for _ in range(int(sys.argv[3])):
                step(parts, data)
            parts["checkpointer"].maybe_wait_for_staging()
            parts["checkpointer"].manager.wait()
            dump(parts, out, "save")
        else:
            assert parts["checkpointer"].load(step=-1), "nothing to resume"
            dump(parts, out, "resume")
            for _ in range(2):  # it trains on, and saves, at its own world size
                step(parts, data)
            parts["checkpointer"].manager.wait()
        parts["checkpointer"].close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
