"""torchtitan's checkpoint managers side by side on one CPU job: ours
(``mithril_async.integrations.torchtitan``, default configuration: the checkpoint worker)
and torchtitan's own DCP manager in its async mode (``async_mode = "async"``).

The job is built as torchtitan's trainer builds it: its ``OptimizersContainer`` (AdamW),
``LRSchedulersContainer`` and ``ParallelAwareDataloader``, a model of ``--mib`` MiB of fp32
weights (with AdamW's two moments the saved state is ~3x that); one training step between
saves, so every save holds new values. Per save: the **stall** (how long ``save(step)``
blocks the training loop, plus ``maybe_wait_for_staging()`` before the next optimizer step,
which is where torchtitan waits for its staging) and **e2e** (from the save's start until it
is durable: ours ``manager.wait()``, DCP's ``save_future``). Medians over ``--saves`` saves
(the first save of each is reported apart: it pays start-up), ratios ours / theirs.

    python benchmarks/bench_torchtitan.py [--mib 256] [--saves 5] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset


class _Batches(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, width: int) -> None:
        self.width, self.pos = width, 0

    def __iter__(self) -> Any:
        while True:
            self.pos += 1
            yield torch.randn(self.width), torch.randn(self.width)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def _job(mib: int, ckpt: Any, folder: str) -> dict[str, Any]:
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    width = 1024
    layers = max(1, (mib << 20) // (4 * width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizers = default_adamw(lr=1e-4, fused=False).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=1000)
    loader = ParallelAwareDataloader(_Batches(width), dp_rank=0, dp_world_size=1, batch_size=4)
    checkpointer = ckpt.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                              lr_schedulers=schedulers, states={}, sd_adapter=None,
                              base_folder=folder)
    return {"model": model, "opt": optimizers, "sched": schedulers, "data": iter(loader),
            "ckpt": checkpointer}


def _train_step(job: dict[str, Any]) -> None:
    x, y = next(job["data"])
    nn.functional.mse_loss(job["model"](x), y).backward()
    job["ckpt"].maybe_wait_for_staging()
    job["opt"].step()
    job["sched"].step()
    job["opt"].zero_grad()


def _durable(job: dict[str, Any], ours: bool) -> None:
    if ours:
        job["ckpt"].manager.wait()
    elif job["ckpt"].save_future is not None:
        job["ckpt"].save_future.result()


def run(name: str, ckpt: Any, args: argparse.Namespace, ours: bool) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix=f"bench-titan-{name.split()[0]}-", dir=args.dir)
    try:
        job = _job(args.mib, ckpt, folder)
        if ours:
            job["ckpt"].manager.worker_ready(60)  # as a job that has trained a while
        stalls, e2es = [], []
        for step in range(1, args.saves + 2):
            _train_step(job)
            t0 = time.perf_counter()
            job["ckpt"].save(step)
            job["ckpt"].maybe_wait_for_staging()  # where the next optimizer step would wait
            stalls.append(time.perf_counter() - t0)
            _durable(job, ours)
            e2es.append(time.perf_counter() - t0)
        job["ckpt"].close()
        written = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"name": name, "first_stall": stalls[0], "first_e2e": e2es[0],
            "stall": statistics.median(stalls[1:]), "e2e": statistics.median(e2es[1:]),
            "stalls": stalls[1:], "e2es": e2es[1:], "mib": written / 2**20}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="fp32 weights (the state is ~3x)")
    ap.add_argument("--saves", type=int, default=5, help="measured saves (after the first)")
    ap.add_argument("--dir", default="/dev/shm", help="where checkpoints go (tmpfs)")
    args = ap.parse_args(argv)
    from torchtitan.components.checkpointer.dcp import CheckpointManager as DcpManager

    from mithril_async.integrations.torchtitan import MithrilCheckpointManager

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's async mode needs a group
    try:
        common = {"enable": True, "folder": "checkpoint", "interval": 1, "keep_latest_k": 0,
                  "last_save_model_only": False}
        results = [
            run("mithril (worker)", MithrilCheckpointManager.Config(**common), args, True),
            run("DCP async", DcpManager.Config(async_mode="async", **common), args, False),
        ]
    finally:
        dist.destroy_process_group()
    print(f"torchtitan job, {args.mib} MiB fp32 weights + AdamW, {args.saves} saves "
          f"(medians; the first save apart), {args.dir}, torch {torch.__version__}")
    print("| manager | stall s | e2e s | first stall s | first e2e s | MiB written |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['name']} | {r['stall']:.3f} | {r['e2e']:.3f} | {r['first_stall']:.3f} | "
              f"{r['first_e2e']:.3f} | {r['mib']:.1f} |")
    ours, theirs = results
    print(f"ours / DCP async: stall {ours['stall'] / theirs['stall']:.2f}x, "
          f"e2e {ours['e2e'] / theirs['e2e']:.2f}x, bytes {ours['mib'] / theirs['mib']:.2f}x")
    for r in results:
        print(f"  {r['name']}: stalls {[round(s, 3) for s in r['stalls']]}, "
              f"e2e {[round(s, 3) for s in r['e2es']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
