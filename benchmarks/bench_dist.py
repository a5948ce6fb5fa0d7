"""Multi-rank saves: ours vs ``torch.distributed.checkpoint.async_save`` on the same sharded state.

``--world`` ranks (gloo on 127.0.0.1, one process each) hold a model whose weights are DTensors
sharded over the ranks (``Shard(0)``, as FSDP2 would) plus its AdamW state. Each save, every rank
calls the system on its own shards; the two systems alternate save by save so machine load hits
both alike. Per save the slowest rank counts (a collective job waits for it); the table gives
medians over ``--saves`` saves after one warm-up save each.

Each save is followed by one training step (gradients, ``optimizer.step()``) before the loop
waits for the save to be durable, the same for both systems.

* stall: how long checkpointing blocks the training loop: the call (ours: ``save_nowait``, DCP:
  ``async_save`` including ``get_state_dict``) plus, with ``--snapshot overlapped``, the time the
  following ``optimizer.step()`` waited for our background copy (``SaveResult.step_wait_s``).
* ``--gc freeze``: every rank calls ``gc.freeze()`` once its model is built, for both systems.
  A full collection of a rank's ~300 k startup objects takes 80-140 ms here and stops every
  thread (it holds the GIL); with automatic GC one lands in a save window every few saves.
* e2e: from the call until the checkpoint is durable (ours: manifest + aliases committed on rank 0
  after every rank reported; DCP: ``future.result()``, metadata written), the step included.

    python benchmarks/bench_dist.py [--world 2] [--mparams 8] [--saves 5] [--level -3]
                                    [--snapshot overlapped] [--raw] [--gc freeze]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mithril_async import CheckpointManager, parse_config
from mithril_async.distributed import DistCoordinator
from mithril_async.sharded import ShardedModel, ShardedOptimizer


def build_model(mparams: float, world: int) -> torch.nn.Module:
    """Weight-like fp32 matrices, sharded by rows over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = 1024
    layers = max(1, round(mparams * 1e6 / (rows * rows)))
    g = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(rows, rows, bias=False) for _ in range(layers))
    for lin in model:
        w = torch.randn(rows, rows, generator=g) * 0.02
        lin.weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    return model


def build(mparams: float, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """:func:`build_model` with one AdamW step taken."""
    model = build_model(mparams, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(args.mparams, world)
    if args.gc == "freeze":  # both systems alike: what long-running trainers do after setup
        gc.collect()
        gc.freeze()
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp}/runs"\nrun_id = "bench"\n'
                       f"ckpting_save_iter = 1\n[checkpointing.compression]\n"
                       f"level = {args.level}\nthreads = {args.threads}\n"
                       f"enabled = {str(not args.raw).lower()}\n"
                       f'[checkpointing.pipeline]\nsnapshot = "{args.snapshot}"\n')
    manager = CheckpointManager(cfg, {"model": ShardedModel(model),
                                      "optimizer": ShardedOptimizer(model, opt)},
                                sharded_model=True, coordinator=DistCoordinator(timeout_s=300))
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "dcp": []}
    for i in range(args.saves + 1):
        train_step(model, opt)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        fut: Any = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/dcp/{i}")
        t1 = time.perf_counter()
        train_step(model, opt)
        fut.result()
        t2 = time.perf_counter()
        times["dcp"].append((t1 - t0, t2 - t0))
        dist.barrier()
        t0 = time.perf_counter()
        handle = manager.save_nowait(i + 1)
        t1 = time.perf_counter()
        train_step(model, opt)  # an overlapped copy still running makes its step() wait
        res = handle.result()
        t2 = time.perf_counter()
        times["ours"].append((t1 - t0 + res.step_wait_s, t2 - t0))
        dist.barrier()
        if i and rank == 0:  # keep the disk footprint small; warm-up files stay for sizing
            shutil.rmtree(f"{tmp}/dcp/{i}", ignore_errors=True)
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((times, res.bytes_in, res.bytes_out), gathered if rank == 0 else None,
                       dst=0)
    manager.close()
    if rank == 0:
        report(args, world, gathered, folder_bytes(Path(tmp) / "dcp" / "0"))
    dist.destroy_process_group()


def report(args: argparse.Namespace, world: int, gathered: list[Any], dcp_bytes: int) -> None:
    def med(system: str, idx: int) -> float:
        per_save = [max(g[0][system][i][idx] for g in gathered)
                    for i in range(1, args.saves + 1)]  # slowest rank; warm-up excluded
        return statistics.median(per_save)

    raw = sum(g[1] for g in gathered)
    ours_out = sum(g[2] for g in gathered)
    print(f"\n{world} ranks, {raw / 2**20:.0f} MiB of sharded fp32 state "
          f"({raw / world / 2**20:.0f} MiB per rank), "
          f"{'no compression' if args.raw else f'zstd level {args.level}'}, "
          f"{args.threads} codec thread(s) per rank, {args.snapshot} snapshot, gc {args.gc}, "
          f"median of {args.saves} saves, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'':10}{'stall ms':>10}{'e2e s':>9}{'written MiB':>13}")
    for name, system, size in (("DCP", "dcp", dcp_bytes), ("ours", "ours", ours_out)):
        print(f"{name:10}{med(system, 0) * 1e3:10.1f}{med(system, 1):9.3f}"
              f"{size / 2**20:13.1f}")
    print(f"{'ours/DCP':10}{med('ours', 0) / med('dcp', 0):10.2f}"
          f"{med('ours', 1) / med('dcp', 1):9.2f}{ours_out / max(1, dcp_bytes):13.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mparams", type=float, default=8.0, help="global parameters, millions")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--level", type=int, default=-3,
                    help="our zstd level (fp32 mantissas do not compress at any level)")
    ap.add_argument("--threads", type=int, default=2, help="our codec threads per rank")
    ap.add_argument("--raw", action="store_true", help="ours without compression")
    ap.add_argument("--snapshot", choices=["blocking", "overlapped"], default="blocking")
    ap.add_argument("--gc", choices=["auto", "freeze"], default="auto",
                    help="freeze: gc.freeze() after building the model on every rank (full "
                         "collections then skip the ~300 k objects of torch and the model)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench_dist_") as tmp:
        mp.spawn(rank_main, args=(args.world, port, args, tmp), nprocs=args.world)


if __name__ == "__main__":
    main()
