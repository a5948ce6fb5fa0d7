"""The ``mithril`` command.

One function per subcommand: ``_add_<name>(subparsers)`` declares its arguments and sets
``func`` to ``cmd_<name>(args) -> int``. To add a subcommand (ls, inspect, verify, restore,
gc, compress, decompress, ...) write that pair and append the ``_add_`` function to
:data:`SUBCOMMANDS`. Heavy imports happen inside ``cmd_`` functions so ``mithril --help`` is
fast. Exit codes: 0 ok, 1 a MithrilError / OS error (message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

Subparsers = Any  # argparse's _SubParsersAction is private


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


# --- analyze ---------------------------------------------------------------------------------


def _add_analyze(sub: Subparsers) -> None:
    p = sub.add_parser(
        "analyze",
        help="training-dynamics analysis of a sparse-delta directory",
        description="Per-step sparsity, update L2 norm, layer-wise sparsity, K-step sparsity, "
        "mask overlap (Jaccard), update concentration and cumulative sparsity of a "
        "SparseDeltaRecorder directory; writes CSV, JSON and PNG plots.",
    )
    p.add_argument("delta_dir", help="directory holding metadata.json and delta_* files")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument(
        "--k-values", type=_int_list, default=[1, 5, 10], help="K-step windows (default 1,5,10)"
    )
    p.add_argument("--k-stride", type=int, default=1, help="start-step stride of K windows")
    p.add_argument("--max-overlap-steps", type=int, default=64, help="steps in the Jaccard matrix")
    p.add_argument("--no-plots", action="store_true", help="write CSV/JSON only")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args: argparse.Namespace) -> int:
    from mithril_async.delta.analysis import analyze_delta_dir

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
        print(json.dumps(s, indent=1))
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


# --- ls, inspect, verify, restore, gc, compress, decompress -------------------------------


def _add_commands(sub: Subparsers) -> None:
    """The run/file subcommands, one module each in :mod:`mithril_async.commands`."""
    from mithril_async.commands import add_all

    add_all(sub)


#: every subcommand's registration function, in ``--help`` order
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_add_commands, _add_analyze]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mithril", description="mithril_async: async compressed PyTorch checkpoints"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mithril`` console script; returns the exit code."""
    from mithril_async.errors import MithrilError

    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (MithrilError, OSError) as e:
        print(f"mithril {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
