"""Files of a step-delta analysis: CSV tables, ``analysis.json`` and PNG plots.

Why apart from :mod:`mithril_async.step_deltas.analysis`: computing and writing change for
different reasons (a new metric vs. a new output format), and the analysis is used on its own
(tests, notebooks) where nothing should be written. The dependency goes one way: this module
(and :mod:`~mithril_async.step_deltas.plots`) take an :class:`AnalysisReport` from the
analysis; the analysis never imports them. :func:`analyze_delta_dir` is the one call that does
both, as ``mithril analyze`` does.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from typing import Any

from mithril_async.step_deltas.analysis import AnalysisReport, compute_analysis
from mithril_async.step_deltas.plots import plot_all

__all__ = ["analyze_delta_dir", "write_outputs"]


def analyze_delta_dir(
    delta_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    k_values: Sequence[int] = (1, 5, 10),
    *,
    k_stride: int = 1,
    max_overlap_steps: int = 64,
    overlap_budget: float = 3e8,
    plots: bool = True,
) -> AnalysisReport:
    """Compute the analysis (:func:`compute_analysis`); with ``out_dir`` also write its files.

    Files: ``per_step.csv``, ``layers.csv``, ``k_step.csv``, ``analysis.json`` and (with
    ``plots``) ``sparsity_heatmap.png``, ``update_magnitude.png``, ``mask_overlap.png``,
    ``k_step_sparsity.png``.
    """
    report = compute_analysis(
        delta_dir,
        k_values,
        k_stride=k_stride,
        max_overlap_steps=max_overlap_steps,
        overlap_budget=overlap_budget,
    )
    if out_dir is not None:
        write_outputs(report, out_dir, plots=plots)
    return report


def _write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        with open(path, "w", encoding="utf-8") as f:
            f.write("")
        return
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})


def write_outputs(
    report: AnalysisReport, out_dir: str | os.PathLike[str], plots: bool = True
) -> list[str]:
    """Write the CSV/JSON (and PNG) files of ``report`` into ``out_dir``; return their paths."""
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    written = []
    for name, rows in (
        ("per_step.csv", report.per_step),
        ("layers.csv", report.layer_rows),
        ("k_step.csv", report.k_step),
    ):
        path = os.path.join(out, name)
        _write_csv(path, rows)
        written.append(path)
    path = os.path.join(out, "analysis.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_json(), f, indent=1)
    written.append(path)
    if plots:
        written += plot_all(report, out)
    return written
