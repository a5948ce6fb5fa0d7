"""Shared by the fault tests and their subprocess helpers (no pytest import here).

The state is deterministic per step: ``expected_params(step)`` is exactly what a run saved at
``step`` holds, so any restore can be checked bit for bit without keeping copies around.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mithril_async import Config, parse_config

#: the randomized long mode: ``MITHRIL_FAULTS_LONG=1 pytest tests/faults``
LONG = os.environ.get("MITHRIL_FAULTS_LONG", "") not in ("", "0")


def scale(ci: int, long: int) -> int:
    """How many cases to run: ``ci`` normally, ``long`` in the long mode."""
    return long if LONG else ci


class Net(torch.nn.Module):
    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d // 2)


class Counter:
    """A JSON-state object (data-loader position) that must match the model's step."""

    def __init__(self) -> None:
        self.step = -1

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def expected_params(step: int, d: int = 128) -> dict[str, torch.Tensor]:
    """The exact parameters a run holds at ``step`` (a base plus a step-dependent drift)."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, shape in (("a.weight", (d, d)), ("a.bias", (d,)), ("b.weight", (d // 2, d)),
                        ("b.bias", (d // 2,))):
        base = torch.randn(shape, generator=g)
        drift = torch.randn(shape, generator=g)
        out[name] = base + drift * (step * 1e-3)
    # one tensor changes only every 4 steps (dedup / refs between versions)
    out["b.bias"] = out["b.bias"] - drift * (step * 1e-3) + drift * ((step // 4) * 1e-3)
    return out


def set_step(model: Net, counter: Counter, step: int) -> None:
    with torch.no_grad():
        for name, t in expected_params(step, model.a.in_features).items():
            model.get_parameter(name).copy_(t)
    counter.step = step


def matches_step(model: Net, counter: Counter, step: int) -> bool:
    exp = expected_params(step, model.a.in_features)
    return counter.step == step and all(
        torch.equal(model.get_parameter(n).detach(), t) for n, t in exp.items())


def metric(step: int) -> float:
    """A loss that is not monotone in the step, so ``best`` and ``latest`` differ."""
    return float((step * 37) % 11)


def config_text(runs: Path, run_id: str = "run1", *, delta: bool = True, keep_last: int = 3,
                extra: str = "") -> str:
    comp = ("delta = true\nkeyframe_interval = 3\n" if delta else "")
    return (f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "{run_id}"\n'
            f'ckpting_save_iter = 1\nkeep_last = {keep_last}\nbest_metric_name = "loss"\n'
            f"[checkpointing.pipeline]\norphan_age_s = 0\n"
            f"[checkpointing.compression]\nthreads = 1\nchunk_mib = 0.0625\n{comp}{extra}")


def make_config(runs: Path, run_id: str = "run1", **kw: Any) -> Config:
    return parse_config(config_text(runs, run_id, **kw))


def leftovers(run_root: Path) -> tuple[list[str], list[str]]:
    """(version folders without a manifest, temp files) under one run folder.

    Safe to call while a cancelled save's cleanup is still deleting: a folder that vanishes
    during the walk is no leftover (``os.walk`` skips it; ``rglob`` would raise)."""
    partial, tmps = [], []
    vdir = run_root / "versions"
    if vdir.is_dir():
        for v in sorted(vdir.iterdir()):
            # an empty folder (killed between mkdir and the claim) holds no data: every
            # reader ignores it and the next claim of that number reuses it
            try:
                if v.is_dir() and not (v / "manifest.json").exists() and any(v.iterdir()):
                    partial.append(v.name)
            except FileNotFoundError:
                continue
    for top, dirs, files in os.walk(run_root):
        for name in dirs + files:
            if name.startswith(".tmp-") and name != ".tmp-cas.lock":
                tmps.append(str((Path(top) / name).relative_to(run_root)))
    return partial, sorted(tmps)


def save_two_versions(runs: Path) -> None:
    """``runs/run1`` with v000001 and v000002 (model + data counter at steps 1, 2), no delta:
    the intact run the hostile-input tests damage copies of."""
    from mithril_async import CheckpointManager

    model, counter = Net(), Counter()
    with CheckpointManager(make_config(runs, delta=False),
                           {"model": model, "data": counter}) as m:
        for step in (1, 2):
            set_step(model, counter, step)
            m.save_nowait(step, metrics={"loss": metric(step)}).result()
