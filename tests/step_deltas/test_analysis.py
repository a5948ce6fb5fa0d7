"""Analysis metrics on a hand-built delta directory where every value is known exactly,
and the ``mithril analyze`` command end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mithril_async.cli import main
from mithril_async.step_deltas import analyze_delta_dir, compute_analysis, write_outputs
from mithril_async.step_deltas.meta import build_metadata
from mithril_async.step_deltas.sparse import SparseLayerDelta, encode_delta

REPO = Path(__file__).resolve().parents[2]

# base: every value 0.  layer a: shape (10,), layer b: shape (2, 5); 20 parameters.
#   step 1: a[0,1,2] 0->1
#   step 2: a[1] 1->0 (undone), a[2] 1->2, a[3] 0->1; b[0] 0->5
#   step 3: a[2] 2->3; b[0] 5->0 (undone), b[1] 0->1
STEPS: dict[int, dict[str, tuple[tuple[int, ...], list[int], list[float], list[float]]]] = {
    1: {"a": ((10,), [0, 1, 2], [0, 0, 0], [1, 1, 1])},
    2: {"a": ((10,), [1, 2, 3], [1, 1, 0], [0, 2, 1]), "b": ((2, 5), [0], [0], [5])},
    3: {"a": ((10,), [2], [2], [3]), "b": ((2, 5), [0, 1], [5, 0], [0, 1])},
}


def make_delta_dir(root: Path) -> Path:
    entries = []
    for step, layers in STEPS.items():
        deltas = {
            name: SparseLayerDelta(
                shape=shape,
                indices=torch.tensor(idx, dtype=torch.int64),
                values=torch.tensor(new, dtype=torch.float32),
                old=torch.tensor(old, dtype=torch.float32),
            )
            for name, (shape, idx, old, new) in layers.items()
        }
        path = f"delta_{step:06d}.mckp"
        (root / path).write_bytes(encode_delta(step, deltas))
        nnz = sum(d.nnz for d in deltas.values())
        entries.append({"step": step, "path": path, "sparsity": 1 - nnz / 20, "nonzero": nnz})
    meta = build_metadata(
        dtype=torch.float32,
        total_params=20,
        encoding="mckp",
        base=None,
        base_step=None,
        layers={"a": {"shape": [10], "numel": 10}, "b": {"shape": [2, 5], "numel": 10}},
        checkpoints=entries,
    )
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def h2(*ps: float) -> float:
    return -sum(p * math.log2(p) for p in ps if p > 0)


def test_metrics_known_exactly(tmp_path: Path) -> None:
    r = analyze_delta_dir(make_delta_dir(tmp_path), None, k_values=(1, 2, 3))
    ps = {s["step"]: s for s in r.per_step}
    assert [ps[s]["nonzero"] for s in (1, 2, 3)] == [3, 4, 3]
    assert [ps[s]["sparsity"] for s in (1, 2, 3)] == pytest.approx([0.85, 0.80, 0.85])
    assert [ps[s]["update_l2"] for s in (1, 2, 3)] == pytest.approx(
        [math.sqrt(3), math.sqrt(28), math.sqrt(27)]
    )
    assert ps[1]["jaccard_prev"] is None
    assert ps[2]["jaccard_prev"] == pytest.approx(2 / 5)
    assert ps[3]["jaccard_prev"] == pytest.approx(2 / 5)
    assert [ps[s]["cumulative_sparsity"] for s in (1, 2, 3)] == pytest.approx([0.85, 0.8, 0.8])
    assert [ps[s]["cumulative_union_sparsity"] for s in (1, 2, 3)] == pytest.approx(
        [0.85, 0.75, 0.7]
    )
    assert ps[1]["entropy_nnz"] == 0.0
    assert ps[2]["entropy_nnz"] == pytest.approx(h2(0.75, 0.25))
    assert ps[2]["entropy_l2"] == pytest.approx(h2(3 / 28, 25 / 28))
    assert ps[2]["entropy_l2_norm"] == pytest.approx(h2(3 / 28, 25 / 28))  # log2(2 layers) = 1

    k = {(row["k"], row["start_step"]): row for row in r.k_step}
    assert {key: k[key]["net_nonzero"] for key in k} == {
        (1, 1): 3, (1, 2): 4, (1, 3): 3, (2, 1): 4, (2, 2): 4, (3, 1): 4,
    }  # fmt: skip
    assert k[(2, 1)]["sparsity"] == pytest.approx(0.8)
    assert k[(2, 1)]["union_sparsity"] == pytest.approx(0.75)
    assert k[(3, 1)]["union_sparsity"] == pytest.approx(0.7)
    assert k[(3, 1)]["end_step"] == 3

    assert r.overlap_steps == [1, 2, 3]
    want = [[1, 0.4, 0.2], [0.4, 1, 0.4], [0.2, 0.4, 1]]
    for got_row, want_row in zip(r.overlap_matrix, want, strict=True):
        assert got_row == pytest.approx(want_row)
    assert r.reuse_histogram == {1: 3, 2: 2, 3: 1}
    layer = {(row["step"], row["layer"]): row["sparsity"] for row in r.layer_rows}
    assert layer[(1, "a")] == pytest.approx(0.7) and layer[(1, "b")] == 1.0
    assert layer[(3, "b")] == pytest.approx(0.8)
    assert r.summary["final_cumulative_sparsity"] == pytest.approx(0.8)
    assert r.summary["k_step_mean_sparsity"]["2"] == pytest.approx(0.8)
    assert r.summary["never_changed_layers"] == []


def test_k_stride_and_bad_k(tmp_path: Path) -> None:
    d = make_delta_dir(tmp_path)
    r = analyze_delta_dir(d, None, k_values=(1,), k_stride=2)
    assert [row["start_step"] for row in r.k_step] == [1, 3]
    with pytest.raises(ValueError):
        analyze_delta_dir(d, None, k_values=(0,))


def test_computing_writes_nothing_and_the_report_writes_what_it_computed(tmp_path: Path) -> None:
    d = make_delta_dir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    r = compute_analysis(d, k_values=(1, 2))
    assert sorted(tmp_path.rglob("*")) == before
    paths = write_outputs(r, tmp_path / "out", plots=False)
    assert [Path(p).name for p in paths] == ["per_step.csv", "layers.csv", "k_step.csv",
                                             "analysis.json"]
    assert json.loads(Path(paths[-1]).read_text()) == json.loads(json.dumps(r.to_json()))


def test_cli_analyze_subprocess(tmp_path: Path) -> None:
    (tmp_path / "deltas").mkdir()
    d = make_delta_dir(tmp_path / "deltas")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-m", "mithril_async.cli", "analyze", str(d), "--out", str(out),
         "--k-values", "1,2", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["num_steps"] == 3
    assert summary["k_step_mean_sparsity"] == {
        "1": pytest.approx((0.85 + 0.8 + 0.85) / 3),
        "2": pytest.approx(0.8),
    }
    for name in ("per_step.csv", "layers.csv", "k_step.csv", "analysis.json"):
        assert (out / name).stat().st_size > 0, name
    for name in ("sparsity_heatmap.png", "update_magnitude.png", "mask_overlap.png",
                 "k_step_sparsity.png"):  # fmt: skip
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    rows = (out / "per_step.csv").read_text().splitlines()
    assert rows[0].startswith("step,nonzero,density,sparsity,update_l2")
    assert len(rows) == 4
    full = json.loads((out / "analysis.json").read_text())
    assert full["mask_overlap"]["steps"] == [1, 2, 3]


def test_cli_errors_and_help(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1
    assert "metadata.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(tmp_path), "--out", str(tmp_path), "--k-values", "0,x"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main([])
    d = make_delta_dir(tmp_path)
    assert main(["analyze", str(d), "--out", str(tmp_path / "o2"), "--no-plots"]) == 0
    assert "3 steps (1..3)" in capsys.readouterr().out
    assert not (tmp_path / "o2" / "mask_overlap.png").exists()


def _random_dir(root: Path, seed: int, steps: int = 7) -> dict[int, dict[str, torch.Tensor]]:
    """A random recording over int32 'bit' values (float32 storage); returns the dense values
    after every step, the naive reference the metrics are checked against."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"x": (6, 5), "y": (13,), "z": (4,)}
    cur = {n: torch.zeros(s, dtype=torch.float32) for n, s in shapes.items()}
    history = {0: {n: t.clone() for n, t in cur.items()}}
    entries = []
    for step in range(1, steps + 1):
        deltas = {}
        for n, t in cur.items():
            flat = t.view(-1)
            mask = torch.rand(flat.numel(), generator=g) < 0.4
            # values from a tiny set so that updates are sometimes undone
            new = torch.randint(0, 3, (flat.numel(),), generator=g).float()
            idx = (mask & (new != flat)).nonzero().squeeze(1)
            if idx.numel():
                deltas[n] = SparseLayerDelta(tuple(t.shape), idx, new[idx], flat[idx].clone())
                flat[idx] = new[idx]
        path = f"delta_{step:06d}.mckp"
        (root / path).write_bytes(encode_delta(step, deltas))
        entries.append({"step": step, "path": path})
        history[step] = {n: t.clone() for n, t in cur.items()}
    meta = build_metadata(
        dtype=torch.float32, total_params=47, encoding="mckp", base=None, base_step=None,
        layers={n: {"shape": list(s), "numel": math.prod(s)} for n, s in shapes.items()},
        checkpoints=entries,
    )  # fmt: skip
    (root / "metadata.json").write_text(json.dumps(meta))
    return history


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_naive_reference(tmp_path: Path, seed: int) -> None:
    hist = _random_dir(tmp_path, seed)
    r = analyze_delta_dir(tmp_path, None, k_values=(1, 2, 3, 7))
    strided = analyze_delta_dir(tmp_path, None, k_values=(2, 3), k_stride=3).k_step
    assert {(x["k"], x["start_step"]) for x in strided} == {(2, 1), (2, 4), (3, 1), (3, 4)}

    def flat(step: int) -> torch.Tensor:
        return torch.cat([hist[step][n].view(-1) for n in ("x", "y", "z")])

    def mask(step: int) -> set[int]:
        return set((flat(step) != flat(step - 1)).nonzero().squeeze(1).tolist())

    for row in [*r.k_step, *strided]:  # net change = value after the window differs from before it
        a, b = row["start_step"], row["end_step"]
        assert row["net_nonzero"] == int((flat(b) != flat(a - 1)).sum())
        union = set().union(*(mask(s) for s in range(a, b + 1)))
        assert row["union_nonzero"] == len(union)
    for ps in r.per_step:
        s = ps["step"]
        assert ps["nonzero"] == len(mask(s))
        assert ps["cumulative_nonzero"] == int((flat(s) != flat(0)).sum())
        if s > 1:
            m0, m1 = mask(s - 1), mask(s)
            want = len(m0 & m1) / len(m0 | m1) if m0 | m1 else 1.0
            assert ps["jaccard_prev"] == pytest.approx(want)
    for i, a in enumerate(r.overlap_steps):
        for j, b in enumerate(r.overlap_steps):
            ma, mb = mask(a), mask(b)
            want = len(ma & mb) / len(ma | mb) if ma | mb else 1.0
            assert r.overlap_matrix[i][j] == pytest.approx(want)
    touches: dict[int, int] = {}
    for s in range(1, 8):
        for p in mask(s):
            touches[p] = touches.get(p, 0) + 1
    want_hist: dict[int, int] = {}
    for c in touches.values():
        want_hist[c] = want_hist.get(c, 0) + 1
    assert r.reuse_histogram == want_hist


def test_overlap_is_sampled_above_budget(tmp_path: Path) -> None:
    _random_dir(tmp_path, 3)
    r = analyze_delta_dir(tmp_path, None, k_values=(1,), overlap_budget=50)
    assert 0 < r.overlap_sampled_fraction < 1
    m = r.overlap_matrix
    assert all(0.0 <= v <= 1.0 for row in m for v in row)
    assert all(m[i][i] == 1.0 for i in range(len(m)))
    assert r.to_json()["mask_overlap"]["sampled_fraction"] == r.overlap_sampled_fraction
