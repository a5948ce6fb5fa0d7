"""PNG plots of an :class:`~mithril_async.step_deltas.analysis.AnalysisReport`.

matplotlib is imported lazily with the non-interactive Agg backend, so the analysis itself
(and everything importing ``mithril_async.step_deltas``) works without it and never needs a
display. Like :mod:`~mithril_async.step_deltas.report`, this module only writes what the
analysis computed; the analysis does not import it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mithril_async.step_deltas.analysis import AnalysisReport

_MAX_TICKS = 40


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ticks(n: int) -> list[int]:
    if n <= _MAX_TICKS:
        return list(range(n))
    stride = int(np.ceil(n / _MAX_TICKS))
    return list(range(0, n, stride))


def plot_sparsity_heatmap(report: AnalysisReport, path: str) -> str:
    """Per-layer sparsity (rows) over recorded steps (columns)."""
    plt = _plt()
    m = report.layer_sparsity_matrix()
    steps = [s["step"] for s in report.per_step]
    names = report.layer_names
    h = min(max(2.5, 0.28 * len(names) + 1.5), 30)
    w = min(max(6.0, 0.12 * len(steps) + 4), 24)
    fig, ax = plt.subplots(figsize=(w, h))
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0, vmax=1.0)
    yt = _ticks(len(names))
    ax.set_yticks(yt, [names[i] for i in yt], fontsize=7)
    xt = _ticks(len(steps))
    ax.set_xticks(xt, [str(steps[i]) for i in xt], fontsize=7, rotation=90)
    ax.set_xlabel("step")
    ax.set_title("Per-layer sparsity (fraction of parameters unchanged by the step)")
    fig.colorbar(im, ax=ax, label="sparsity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_update_magnitude(report: AnalysisReport, path: str) -> str:
    """Update L2 norm per step (log scale) above sparsity, cumulative sparsity and Jaccard."""
    plt = _plt()
    ps = report.per_step
    steps = [s["step"] for s in ps]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    l2 = np.array([s["update_l2"] for s in ps], dtype=float)
    a1.plot(steps, l2, marker=".", color="tab:blue")
    if np.any(l2 > 0):
        a1.set_yscale("log")
    a1.set_ylabel("update L2 norm")
    a1.set_title("Update magnitude timeline")
    a1.grid(alpha=0.3)
    a2.plot(steps, [s["sparsity"] for s in ps], marker=".", label="step sparsity")
    a2.plot(steps, [s["cumulative_sparsity"] for s in ps], label="cumulative sparsity (net)")
    a2.plot(
        steps,
        [s["cumulative_union_sparsity"] for s in ps],
        linestyle="--",
        label="cumulative sparsity (touched)",
    )
    jac = [(s["step"], s["jaccard_prev"]) for s in ps if s["jaccard_prev"] is not None]
    if jac:
        a2.plot(*zip(*jac, strict=True), marker="x", label="Jaccard vs previous step")
    a2.set_ylim(-0.02, 1.02)
    a2.set_xlabel("step")
    a2.set_ylabel("fraction")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_mask_overlap(report: AnalysisReport, path: str) -> str:
    """Pairwise Jaccard overlap of the changed-parameter masks between steps."""
    plt = _plt()
    m = np.array(report.overlap_matrix, dtype=float).reshape(
        len(report.overlap_steps), len(report.overlap_steps)
    )
    steps = report.overlap_steps
    fig, ax = plt.subplots(figsize=(7, 6))
    im = ax.imshow(m, interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0)
    t = _ticks(len(steps))
    ax.set_xticks(t, [str(steps[i]) for i in t], fontsize=7, rotation=90)
    ax.set_yticks(t, [str(steps[i]) for i in t], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("step")
    ax.set_title("Mask overlap (Jaccard of changed parameters)")
    fig.colorbar(im, ax=ax, label="Jaccard")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_k_step(report: AnalysisReport, path: str) -> str:
    """Net K-step sparsity over window start, one line per K (dashed: touched-at-all)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    ks = sorted({r["k"] for r in report.k_step})
    for i, k in enumerate(ks):
        rows = [r for r in report.k_step if r["k"] == k]
        color = f"C{i % 10}"
        x = [r["start_step"] for r in rows]
        ax.plot(x, [r["sparsity"] for r in rows], color=color, label=f"K={k} net")
        ax.plot(x, [r["union_sparsity"] for r in rows], color=color, linestyle="--", alpha=0.6)
    ax.set_xlabel("window start step")
    ax.set_ylabel("sparsity")
    ax.set_title("K-step sparsity (solid: net change, dashed: touched at all)")
    ax.grid(alpha=0.3)
    if ks:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(report: AnalysisReport, out_dir: str) -> list[str]:
    """Write every plot into ``out_dir``; return the paths."""
    return [
        plot_sparsity_heatmap(report, os.path.join(out_dir, "sparsity_heatmap.png")),
        plot_update_magnitude(report, os.path.join(out_dir, "update_magnitude.png")),
        plot_mask_overlap(report, os.path.join(out_dir, "mask_overlap.png")),
        plot_k_step(report, os.path.join(out_dir, "k_step_sparsity.png")),
    ]
