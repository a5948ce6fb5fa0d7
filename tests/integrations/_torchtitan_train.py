"""A torchtitan-style training loop on the CPU, driven as torchtitan's ``Trainer`` drives its
checkpoint manager (``load`` before the loop, ``maybe_wait_for_staging`` before each optimizer
step, ``save(step, last_step)`` after each step, ``close`` at the end), with torchtitan's own
``OptimizersContainer``, ``LRSchedulersContainer`` and ``ParallelAwareDataloader``.

    python _torchtitan_train.py OUT_DIR MODE STEPS [AFTER]

MODE ``run``: train from scratch (or resume from the run in OUT_DIR) to STEPS and write the
final model, optimizer, scheduler, loader and RNG states (and the step it started from) to
``OUT_DIR/final.pt``. MODE ``stop``: as ``run``
(the LR schedule still spans STEPS), but the job ends cleanly after step AFTER. MODE ``crash``:
as ``run``, but once step AFTER's save has returned, write ``OUT_DIR/ready`` (the
checkpoint worker's pid) and wait to be killed. The model has dropout (the global RNG) and the
data comes in a new order each epoch (9 steps of 8 pairs cross the 64-pair epoch), so only a
resume that restores the RNG and the loader position ends where an uninterrupted run ends. The
loader has its own generator: an iterator of one without draws from the global RNG when it
starts, which a resumed run does at another point than an uninterrupted one. With
``WORLD_SIZE`` > 1 in the environment (and ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) it is one
rank of a gloo data-parallel job: each rank its own data, gradients averaged, and
``OUT_DIR/final-rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from mithril_async.integrations.torchtitan import MithrilCheckpointManager


class Pairs(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream of (x, y) pairs in a new order each epoch, its position its own
    state, as torchtitan's text datasets keep theirs (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, n: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)
        self.epoch = self.pos = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            order = torch.randperm(len(self.x),
                                   generator=torch.Generator().manual_seed(100 + self.epoch))
            while self.pos < len(self.x):
                i = int(order[self.pos])
                self.pos += 1
                yield self.x[i], self.y[i]
            self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


class TrainState:
    """The trainer's own state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(out: str, ckpt: MithrilCheckpointManager.Config, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizers = default_adamw(lr=1e-2, fused=False).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps)
    rank, world = _rank_world()
    loader = ParallelAwareDataloader(Pairs(seed=1 + rank), dp_rank=rank, dp_world_size=world,
                                     batch_size=8,
                                     generator=torch.Generator().manual_seed(2))
    state = TrainState()
    checkpointer = ckpt.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                              lr_schedulers=schedulers, states={"train_state": state},
                              sd_adapter=None, base_folder=out)
    return {"model": model, "optimizers": optimizers, "schedulers": schedulers,
            "loader": loader, "state": state, "checkpointer": checkpointer}


def batches(loader: ParallelAwareDataloader) -> Iterator[Any]:
    yield from loader


def train(parts: dict[str, Any], steps: int, kill_after: int | None, out: str,
          stop_after: int | None = None) -> None:
    model, opt, sched = parts["model"], parts["optimizers"], parts["schedulers"]
    state, ckpt = parts["state"], parts["checkpointer"]
    ckpt.load(step=-1)
    start = state.step
    data = batches(parts["loader"])
    while state.step < steps:
        state.step += 1
        x, y = next(data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if dist.is_initialized():  # data parallel: every rank steps with the mean gradient
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        ckpt.maybe_wait_for_staging()
        opt.step()
        sched.step()
        opt.zero_grad()
        state.ntokens_seen += x.shape[0]
        ckpt.save(state.step, last_step=state.step == steps)
        if kill_after is not None and state.step == kill_after:
            with open(os.path.join(out, "ready.tmp"), "w") as f:
                f.write(str(ckpt.manager.worker_pid or ""))
            os.rename(os.path.join(out, "ready.tmp"), os.path.join(out, "ready"))
            while True:  # the test kills this process here, a save possibly in flight
                time.sleep(1)
        if stop_after is not None and state.step == stop_after:
            break
    ckpt.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "loader": parts["loader"].state_dict(),
                "state": state.state_dict(), "rng": torch.get_rng_state(),
                "started_at": start},
               os.path.join(out, "final.pt" if not dist.is_initialized()
                            else f"final-rank{dist.get_rank()}.pt"))


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def main() -> None:
    if _rank_world()[1] > 1:  # launched as torchrun would (MASTER_ADDR/PORT, RANK, WORLD_SIZE)
        dist.init_process_group("gloo")
    out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kill_after = int(sys.argv[4]) if mode == "crash" else None
    stop_after = int(sys.argv[4]) if mode == "stop" else None
    ckpt = MithrilCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=2, keep_latest_k=3,
        last_save_model_only=False,
        mithril={"checkpointing": {"pipeline": {"process": "worker"},
                                   "compression": {"threads": 1}}})
    try:
        train(build(out, ckpt, steps), steps, kill_after, out, stop_after)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
