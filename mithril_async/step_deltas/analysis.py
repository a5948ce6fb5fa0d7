"""Training-dynamics analysis of a sparse-delta recording .

Definitions (``N`` = total tracked parameters, ``mask_t`` = positions changed at step ``t``):

- sparsity_t = 1 - |mask_t| / N (fraction unchanged; 0.99 = 99% sparse) and
  density_t = |mask_t| / N.
- update_l2_t = ||new - old||_2 over all layers (float64 from the stored old/new values).
- layer sparsity: the same per layer (``layers.csv``, the heatmap).
- K-step sparsity over the window of K consecutive recorded steps starting at t:
  1 - nnz(delta_t + ... + delta_{t+K-1}) / N, where a position counts when its value after
  the window differs *bitwise* from its value before it (exact "net change"; an update undone
  within the window does not count). ``union_sparsity`` is 1 - |union of the masks| / N (touched
  at all); the gap between them shows updates that cancel.
- Jaccard(t, t') = |mask_t & mask_t'| / |mask_t | mask_t'| over all layers (1.0 when both
  masks are empty).
- update concentration: Shannon entropy (bits) of the distribution of the update across
  layers, by squared L2 (``entropy_l2``) and by changed-count (``entropy_nnz``), and the same
  normalised by log2(number of tracked layers) (1 = spread evenly, 0 = one layer).
- cumulative sparsity_t: K-step sparsity of the window from the first step through t; and
  ``cumulative_union_sparsity`` (touched at least once so far).
- reuse: how many parameters were changed in exactly n steps (a histogram).

Memory is O(stored nonzeros) (the COO pieces of every step are held as numpy arrays) plus a
few bytes per parameter of the largest layer (:mod:`mithril_async.step_deltas.dynamics`). The
mask-overlap matrix covers at most ``max_overlap_steps`` evenly spaced steps and is estimated
on a hashed subset of positions when exact counting would exceed ``overlap_budget`` lookups
(``mask_overlap.sampled_fraction`` in ``analysis.json`` says which).

This module only computes: :func:`compute_analysis` returns an :class:`AnalysisReport` and
writes nothing. Writing it out (CSV, JSON, plots) is :mod:`mithril_async.step_deltas.report`'s
job, which imports this module and never the other way round, so the metrics can be used (and
tested) without touching the file system.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mithril_async.errors import InvalidFormat
from mithril_async.step_deltas.dynamics import Pieces, Totals, accumulate_layer, overlap_fraction
from mithril_async.step_deltas.reconstruct import iter_deltas, read_metadata
from mithril_async.step_deltas.sparse import bits_view


@dataclass
class _Step:
    step: int
    layers: dict[str, Pieces]
    sq: dict[str, float]  # squared L2 of the update per layer


@dataclass
class AnalysisReport:
    """Everything :func:`compute_analysis` computed; ``to_json()`` is ``analysis.json``."""

    delta_dir: str
    dtype: str
    total_params: int
    layer_names: list[str]
    layer_numel: dict[str, int]
    per_step: list[dict[str, Any]]
    layer_rows: list[dict[str, Any]]
    k_step: list[dict[str, Any]]
    overlap_steps: list[int]
    overlap_matrix: list[list[float]]
    reuse_histogram: dict[int, int]
    overlap_sampled_fraction: float = 1.0
    summary: dict[str, Any] = field(default_factory=dict)

    def layer_sparsity_matrix(self) -> np.ndarray:
        """``[layer, step]`` sparsity, rows in ``layer_names`` order."""
        pos = {s["step"]: j for j, s in enumerate(self.per_step)}
        row = {n: i for i, n in enumerate(self.layer_names)}
        m = np.ones((len(self.layer_names), len(self.per_step)))
        for r in self.layer_rows:
            m[row[r["layer"]], pos[r["step"]]] = r["sparsity"]
        return m

    def to_json(self) -> dict[str, Any]:
        return {
            "delta_dir": self.delta_dir,
            "dtype": self.dtype,
            "total_params": self.total_params,
            "summary": self.summary,
            "per_step": self.per_step,
            "k_step": self.k_step,
            "mask_overlap": {
                "steps": self.overlap_steps,
                "jaccard": self.overlap_matrix,
                "sampled_fraction": self.overlap_sampled_fraction,
            },
            "reuse_histogram": {str(k): v for k, v in sorted(self.reuse_histogram.items())},
        }


def _entropy(weights: Sequence[float], n_layers: int) -> tuple[float, float]:
    total = float(sum(weights))
    if total <= 0:
        return 0.0, 0.0
    h = -sum((w / total) * math.log2(w / total) for w in weights if w > 0)
    h = max(h, 0.0)
    return h, (h / math.log2(n_layers) if n_layers > 1 else 0.0)


# --- loading ---------------------------------------------------------------------------------


def _load_steps(delta_dir: str, meta: dict[str, Any]) -> list[_Step]:
    steps = []
    for step, layers in iter_deltas(delta_dir, meta=meta):
        pieces: dict[str, Pieces] = {}
        sq: dict[str, float] = {}
        for name, d in layers.items():
            view = bits_view(d.values.dtype)
            pieces[name] = (
                d.indices.numpy(),
                d.old.view(view).numpy(),
                d.values.view(view).numpy(),
            )
            sq[name] = float((d.update() ** 2).sum())
        steps.append(_Step(step, pieces, sq))
    return steps


def _layer_numel(meta: dict[str, Any], delta_dir: str) -> dict[str, int]:
    if meta.get("layers"):
        return {n: int(v["numel"]) for n, v in meta["layers"].items()}
    raise InvalidFormat(f"{delta_dir}/metadata.json has no 'layers'; layer sizes are unknown")


# --- the analysis ----------------------------------------------------------------------------


def compute_analysis(
    delta_dir: str | os.PathLike[str],
    k_values: Sequence[int] = (1, 5, 10),
    *,
    k_stride: int = 1,
    max_overlap_steps: int = 64,
    overlap_budget: float = 3e8,
) -> AnalysisReport:
    """Compute the metrics of the module docstring from the deltas in ``delta_dir``.

    Reads only; to write the report see
    :func:`~mithril_async.step_deltas.report.analyze_delta_dir`.
    """
    if any(k < 1 for k in k_values) or k_stride < 1:
        raise ValueError(f"K values and stride must be >= 1, got {list(k_values)}, {k_stride}")
    ddir = os.fspath(delta_dir)
    meta = read_metadata(ddir)
    steps = _load_steps(ddir, meta)
    numel = _layer_numel(meta, ddir)
    names = list(numel)
    total = int(meta.get("total_params") or sum(numel.values()))

    pick = _evenly(len(steps), max_overlap_steps)
    windows = {k: list(range(0, len(steps) - k + 1, k_stride)) for k in k_values}
    tot = Totals(num_steps=len(steps), k_windows=windows, overlap_pos=pick)
    tot.overlap_fraction = overlap_fraction(
        [sum(p[0].size for p in steps[i].layers.values()) for i in pick], overlap_budget
    )
    for name in names:
        by_pos = {t: s.layers[name] for t, s in enumerate(steps) if name in s.layers}
        accumulate_layer(tot, numel[name], by_pos)

    per_step, layer_rows = _step_rows(steps, tot, numel, total)
    k_rows = _k_rows(windows, steps, tot, total)

    ov_union = tot.ov_size[:, None] + tot.ov_size[None, :] - tot.ov_inter
    overlap = np.where(ov_union > 0, tot.ov_inter / np.maximum(ov_union, 1), 1.0).tolist()
    reuse = {n: int(c) for n, c in enumerate(tot.reuse) if n > 0 and c > 0}

    report = AnalysisReport(
        delta_dir=ddir,
        dtype=str(meta["dtype"]),
        total_params=total,
        layer_names=names,
        layer_numel=numel,
        per_step=per_step,
        layer_rows=layer_rows,
        k_step=k_rows,
        overlap_steps=[steps[i].step for i in pick],
        overlap_matrix=overlap,
        reuse_histogram=reuse,
        overlap_sampled_fraction=tot.overlap_fraction,
    )
    report.summary = _summary(report, list(k_values))
    return report


def _sparsity(n: int, total: int) -> float:
    """The fraction of ``total`` parameters that ``n`` changed ones leave unchanged."""
    return 1.0 - n / total if total else 1.0


def _step_rows(steps: list[Any], tot: Totals, numel: dict[str, int], total: int
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The per-step rows and the per-(step, layer) rows of the report."""
    names = list(numel)
    n_layers = len(names)
    per_step: list[dict[str, Any]] = []
    layer_rows: list[dict[str, Any]] = []
    sizes = [sum(p[0].size for p in s.layers.values()) for s in steps]
    for t, s in enumerate(steps):
        nnz_by_layer = {n: int(p[0].size) for n, p in s.layers.items()}
        nnz = sizes[t]
        h_l2, hn_l2 = _entropy(list(s.sq.values()), n_layers)
        h_nnz, hn_nnz = _entropy([float(v) for v in nnz_by_layer.values()], n_layers)
        jac = None
        if t > 0:
            inter = int(tot.jac_inter[t])
            union = sizes[t - 1] + nnz - inter
            jac = 1.0 if union == 0 else inter / union
        per_step.append(
            {
                "step": s.step,
                "nonzero": nnz,
                "density": nnz / total if total else 0.0,
                "sparsity": _sparsity(nnz, total),
                "update_l2": math.sqrt(sum(s.sq.values())),
                "changed_layers": len(s.layers),
                "jaccard_prev": jac,
                "entropy_l2": h_l2,
                "entropy_l2_norm": hn_l2,
                "entropy_nnz": h_nnz,
                "entropy_nnz_norm": hn_nnz,
                "cumulative_nonzero": int(tot.cum_net[t]),
                "cumulative_sparsity": _sparsity(int(tot.cum_net[t]), total),
                "cumulative_union_sparsity": _sparsity(int(tot.cum_union[t]), total),
            }
        )
        for n in names:
            k = nnz_by_layer.get(n, 0)
            layer_rows.append(
                {
                    "step": s.step,
                    "layer": n,
                    "nonzero": k,
                    "numel": numel[n],
                    "sparsity": 1.0 - k / numel[n] if numel[n] else 1.0,
                    "update_l2": math.sqrt(s.sq.get(n, 0.0)),
                }
            )
    return per_step, layer_rows


def _k_rows(windows: dict[int, list[int]], steps: list[Any], tot: Totals, total: int
            ) -> list[dict[str, Any]]:
    """One row per window of K consecutive steps: what changed over it (net and union)."""
    k_rows: list[dict[str, Any]] = []
    for k, starts in windows.items():
        for w, i in enumerate(starts):
            net, union = int(tot.k_net[k][w]), int(tot.k_union[k][w])
            k_rows.append(
                {
                    "k": k,
                    "start_step": steps[i].step,
                    "end_step": steps[i + k - 1].step,
                    "net_nonzero": net,
                    "sparsity": _sparsity(net, total),
                    "union_nonzero": union,
                    "union_sparsity": _sparsity(union, total),
                }
            )
    return k_rows


def _evenly(n: int, most: int) -> list[int]:
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def _summary(r: AnalysisReport, k_values: list[int]) -> dict[str, Any]:
    ps = r.per_step
    jac = [s["jaccard_prev"] for s in ps if s["jaccard_prev"] is not None]
    by_layer: dict[str, int] = {}
    for row in r.layer_rows:
        by_layer[row["layer"]] = by_layer.get(row["layer"], 0) + row["nonzero"]
    steps_n = max(len(ps), 1)
    return {
        "num_steps": len(ps),
        "first_step": ps[0]["step"] if ps else None,
        "last_step": ps[-1]["step"] if ps else None,
        "total_params": r.total_params,
        "num_layers": len(r.layer_names),
        "mean_sparsity": _mean([s["sparsity"] for s in ps]),
        "min_sparsity": min((s["sparsity"] for s in ps), default=None),
        "mean_update_l2": _mean([s["update_l2"] for s in ps]),
        "mean_jaccard_consecutive": _mean(jac),
        "mean_entropy_l2_norm": _mean([s["entropy_l2_norm"] for s in ps]),
        "final_cumulative_sparsity": ps[-1]["cumulative_sparsity"] if ps else None,
        "final_cumulative_union_sparsity": ps[-1]["cumulative_union_sparsity"] if ps else None,
        "k_step_mean_sparsity": {
            str(k): _mean([row["sparsity"] for row in r.k_step if row["k"] == k]) for k in k_values
        },
        "k_step_mean_union_sparsity": {
            str(k): _mean([row["union_sparsity"] for row in r.k_step if row["k"] == k])
            for k in k_values
        },
        "layer_mean_sparsity": {
            n: 1.0 - by_layer.get(n, 0) / (r.layer_numel[n] * steps_n) if r.layer_numel[n] else 1.0
            for n in r.layer_names
        },
        "never_changed_layers": [n for n in r.layer_names if by_layer.get(n, 0) == 0],
        "reuse_histogram": {str(k): v for k, v in sorted(r.reuse_histogram.items())},
    }

