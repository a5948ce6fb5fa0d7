"""Host memory at scale: saves of 1, 4 and 8 GiB GPT-like states under host_memory_mib, side
by side with DCP ``async_save`` of the same state in the same process (issue 21).

The state: a GPT-like model of bf16 weights (``layers`` blocks of qkv / proj / MLP weights and
biases, two LayerNorms each, a token and a position embedding) and an AdamW-like optimizer
holding fp32 ``exp_avg`` / ``exp_avg_sq`` and a step counter per parameter: >= 2,000 tensors
whatever the size. The "training loop" is synthetic (no forward over a multi-GB model on a
2-core CPU): a fixed matmul workload stands for forward/backward, then ``optimizer.step()``
updates every parameter and moment in place (the hook of an overlapped snapshot runs there).

Per state size and system, one save inside the loop (``save``, one step, wait for the
commit), each system with a fresh manager (its staging buffers, if any, count):
- ours with ``snapshot = "overlapped"`` and ``host_memory_mib`` = 256, 1024, unlimited;
- DCP ``async_save`` (``no_dist=True``) of ``{"model": sd, "optim": osd}``.
Columns: peak extra RSS (sampled every 2 ms above the RSS before the save, psutil), the
pipeline's own peak account (ours), stall (the save call), step wait (ours: the step's
pre-hook), end-to-end (call to commit), stored bytes; ratios ours/DCP. Medians over
``--runs`` runs. The 8 GiB case is skipped with a printed reason when ``free`` shows less
than 20 GiB available (the machine is shared). Writes a PNG of peak RSS against state size.

    python benchmarks/bench_scale.py --sizes 1 4 8 --runs 3 --png docs/bench_scale.png
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp

from mithril_async import CheckpointManager, parse_config

try:
    from _rss import PeakRSS  # run as a script from benchmarks/
except ImportError:  # pragma: no cover - imported as benchmarks.bench_scale
    from benchmarks._rss import PeakRSS

GiB = 1 << 30
MiB = 1 << 20


class GPT(torch.nn.Module):
    """bf16 weights of a GPT-like stack (only its parameters matter here)."""

    def __init__(self, layers: int, d: int, vocab: int, ctx: int) -> None:
        super().__init__()
        bf = torch.bfloat16

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=bf).normal_(0, 0.02))

        self.wte, self.wpe = p(vocab, d), p(ctx, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            for name, shape in (("ln1_w", (d,)), ("ln1_b", (d,)), ("qkv_w", (3 * d, d)),
                                ("qkv_b", (3 * d,)), ("proj_w", (d, d)), ("proj_b", (d,)),
                                ("ln2_w", (d,)), ("ln2_b", (d,)), ("up_w", (4 * d, d)),
                                ("up_b", (4 * d,)), ("down_w", (d, 4 * d)), ("down_b", (d,))):
                b.register_parameter(name, p(*shape))
            self.blocks.append(b)
        self.lnf_w, self.lnf_b = p(d), p(d)


class FakeAdamW(torch.optim.Optimizer):
    """AdamW's state layout (fp32 moments, a step tensor) and an in-place update of every
    parameter and moment per step (scalar updates, no gradients held). The update allocates
    nothing (mixed-dtype in-place ops allocate a full-size temporary): peak RSS then measures
    the checkpoint, not the optimizer's scratch."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-4) -> None:
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for q in group["params"]:
                # moments as a run under way has them (random, of their usual scales)
                v = torch.empty(q.shape, dtype=torch.float32).normal_(0, 1e-4)
                self.state[q] = {"step": torch.zeros(()),
                                 "exp_avg": torch.empty(q.shape).normal_(0, 1e-3),
                                 "exp_avg_sq": v.mul_(v)}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for q in group["params"]:
                st = self.state[q]
                st["step"].add_(1)
                st["exp_avg"].mul_(0.9).add_(1e-3)  # same-dtype scalars: no temporaries
                st["exp_avg_sq"].mul_(0.999).add_(1e-6)
                q.mul_(1.0 - group["lr"])


def build(size_gib: float) -> tuple[GPT, FakeAdamW, int, int]:
    """A model + optimizer of about ``size_gib`` (10 bytes per parameter), >= 2,000 tensors."""
    vocab, ctx = 50304, 2048
    target = size_gib * GiB / 10  # parameters
    # 12 d^2 per block, (vocab + ctx) d for the embeddings; 48 blocks give d, rounded to a
    # multiple of 64; then the number of blocks (>= 42: >= 2,000 tensors) meets the target
    d0 = (-(vocab + ctx) + math.sqrt((vocab + ctx) ** 2 + 4 * 12 * 48 * target)) / (2 * 12 * 48)
    d = max(64, round(d0 / 64) * 64)
    layers = max(42, round((target - (vocab + ctx) * d) / (12 * d * d)))
    model = GPT(layers, d, vocab, ctx)
    opt = FakeAdamW(model.parameters())
    n_tensors = len(model.state_dict()) + 3 * len(opt.state)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return model, opt, n_tensors, nbytes


def fwd_bwd() -> None:
    """Stands for forward/backward: a fixed compute that reads no checkpointed tensor."""
    a = torch.ones(768, 768)
    for _ in range(6):
        a = torch.tanh(a @ a * 1e-3)


def trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def ours(model: GPT, opt: FakeAdamW, root: Path, budget: int | None,
         snapshot: str = "overlapped", compress: bool = True) -> dict[str, float]:
    pipe = f'snapshot = "{snapshot}"\n' + (f"host_memory_mib = {budget}\n" if budget else "")
    cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "b"\n'
                       f"[checkpointing.pipeline]\n{pipe}"
                       f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n")
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m, PeakRSS() as rss:
        t0 = time.perf_counter()
        handle = m.save_nowait(1)
        stall = time.perf_counter() - t0
        fwd_bwd()
        opt.step()
        res = handle.result()
        e2e = time.perf_counter() - t0
    return {"rss": rss.peak_extra, "acct": res.host_peak_bytes, "stall": stall,
            "wait": res.step_wait_s, "e2e": e2e, "stored": res.bytes_out,
            "streamed": float(res.streamed), "mbs": res.bytes_in / 1e6 / res.total_s}


def dcp_async(model: GPT, opt: FakeAdamW, root: Path) -> dict[str, float]:
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        fut: Any = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                  checkpoint_id=str(root / "dcp"), no_dist=True)
        stall = time.perf_counter() - t0
        fwd_bwd()
        opt.step()
        fut.result()
        e2e = time.perf_counter() - t0
    return {"rss": rss.peak_extra, "acct": 0.0, "stall": stall, "wait": 0.0, "e2e": e2e,
            "stored": du(root / "dcp"), "streamed": 0.0, "mbs": 0.0}


def run_size(size: float, args: argparse.Namespace
             ) -> dict[tuple[float, str], dict[str, float]]:
    """Every system on one state of ``size`` GiB, alternating, ``--runs`` times; medians."""
    model, opt, n_tensors, nbytes = build(size)
    for _ in range(2):  # moments of a run under way
        opt.step()
    print(f"-- state {nbytes / GiB:.2f} GiB, {n_tensors} tensors "
          f"(available {available_gib():.1f} GiB)")
    runs = args.runs if size < 4 else args.runs_big
    systems: list[tuple[str, Callable[[Path], dict[str, float]]]] = [
        (f"ours {b} MiB" if b else "ours unlimited",
         (lambda root, b=b: ours(model, opt, root, b or None, args.snapshot,
                                 not args.no_compression)))
        for b in args.budgets]
    if not args.no_dcp:
        systems.append(("DCP async_save", lambda root: dcp_async(model, opt, root)))
    per: dict[str, list[dict[str, float]]] = {name: [] for name, _ in systems}
    for r in range(runs):
        for name, fn in systems:  # alternating: drifts of the shared machine spread out
            root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_scale_"))
            try:
                trim()
                row = fn(root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
                trim()
            per[name].append(row)
            print(f"   run {r + 1} {name:<16} rss {row['rss'] / MiB:8.0f} MiB  "
                  f"acct {row['acct'] / MiB:7.0f} MiB  stall {row['stall']:7.3f} s  "
                  f"wait {row['wait']:7.3f} s  e2e {row['e2e']:7.2f} s  "
                  f"stored {row['stored'] / GiB:6.2f} GiB", flush=True)
    return {(size, name): {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            | {"runs": float(len(rows)), "nbytes": float(nbytes), "tensors": float(n_tensors)}
            for name, rows in per.items()}


def available_gib() -> float:
    return psutil.virtual_memory().available / GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024, 0],
                    help="host_memory_mib values; 0 = unlimited")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--runs-big", type=int, default=1, help="runs of states >= 4 GiB")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--snapshot", choices=["overlapped", "blocking"], default="overlapped")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--no-compression", action="store_true",
                    help="ours without compression (what a budget costs the loop when the "
                         "copy-out runs at write speed instead of the encoder's)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results: dict[tuple[float, str], dict[str, float]] = {}
    cores = os.cpu_count() or 1
    print(f"cores {cores}, torch {torch.__version__}, available {available_gib():.1f} GiB, "
          f"snapshot = {args.snapshot}")
    for size in args.sizes:
        if size >= 8 and available_gib() < 20:
            print(f"-- {size:g} GiB skipped: {available_gib():.1f} GiB available < 20 GiB "
                  "(shared machine)")
            continue
        results |= run_size(size, args)
    print()
    print("| state | tensors | system | runs | peak extra RSS | own account | stall | "
          "step wait | end-to-end | stored | MB/s per core | RSS / DCP | stall+wait / DCP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (size, name), r in results.items():
        ref = results.get((size, "DCP async_save"))
        ratio_rss = r["rss"] / ref["rss"] if ref and ref["rss"] else float("nan")
        ratio_stall = ((r["stall"] + r["wait"]) / ref["stall"] if ref and ref["stall"]
                       else float("nan"))
        acct = f"{r['acct'] / MiB:.0f} MiB" if name != "DCP async_save" else "-"
        mbs = f"{r['mbs'] / cores:.0f}" if r["mbs"] else "-"
        print(f"| {r['nbytes'] / GiB:.2f} GiB | {r['tensors']:.0f} | {name} | {r['runs']:.0f} "
              f"| {r['rss'] / MiB:.0f} MiB | {acct} | {r['stall']:.3f} s | {r['wait']:.3f} s "
              f"| {r['e2e']:.2f} s | {r['stored'] / GiB:.2f} GiB | {mbs} "
              f"| {ratio_rss:.3f} | {ratio_stall:.2f} |")
    if args.png is not None:
        plot(results, args.png)


def plot(results: dict[tuple[float, str], dict[str, float]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = sorted({name for _, name in results}, key=lambda n: (n.startswith("DCP"), n))
    for name in names:
        pts = sorted((r["nbytes"] / GiB, r["rss"] / MiB) for (s, n), r in results.items()
                     if n == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("state size (GiB)")
    ax.set_ylabel("peak extra RSS during the save (MiB)")
    ax.set_yscale("log")
    ax.set_title("Host memory of one save: host_memory_mib vs DCP async_save")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
