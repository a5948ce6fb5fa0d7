"""``mithril analyze DELTA_DIR --out DIR``: training dynamics of a sparse-delta directory.

Per-step sparsity, update L2 norm, layer-wise sparsity, K-step sparsity, mask overlap
(Jaccard), update concentration and cumulative sparsity of a SparseDeltaRecorder directory;
writes CSV, JSON and PNG plots.
"""

from __future__ import annotations

import argparse
from typing import Any

from mithril_async.commands._common import print_json


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(sub: Any) -> None:
    p = sub.add_parser("analyze", help="training-dynamics analysis of a sparse-delta directory",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("delta_dir", help="directory holding metadata.json and delta_* files")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument(
        "--k-values", type=_int_list, default=[1, 5, 10], help="K-step windows (default 1,5,10)"
    )
    p.add_argument("--k-stride", type=int, default=1, help="start-step stride of K windows")
    p.add_argument("--max-overlap-steps", type=int, default=64, help="steps in the Jaccard matrix")
    p.add_argument("--no-plots", action="store_true", help="write CSV/JSON only")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mithril_async.step_deltas.report import analyze_delta_dir

    report = analyze_delta_dir(
        args.delta_dir,
        args.out,
        k_values=args.k_values,
        k_stride=args.k_stride,
        max_overlap_steps=args.max_overlap_steps,
        plots=not args.no_plots,
    )
    s = report.summary
    if args.json:
        print_json(s)
        return 0
    print(
        f"{s['num_steps']} steps ({s['first_step']}..{s['last_step']}), "
        f"{s['total_params']} parameters in {s['num_layers']} layers, dtype {report.dtype}"
    )
    if s["num_steps"]:
        print(
            f"mean sparsity {s['mean_sparsity']:.4f} (min {s['min_sparsity']:.4f}), "
            f"mean update L2 {s['mean_update_l2']:.4g}"
        )
        print(
            f"final cumulative sparsity {s['final_cumulative_sparsity']:.4f} "
            f"(touched: {s['final_cumulative_union_sparsity']:.4f})"
        )
        for k, v in s["k_step_mean_sparsity"].items():
            if v is not None:
                print(f"K={k}: mean net sparsity {v:.4f}")
    print(f"wrote results to {args.out}")
    return 0
