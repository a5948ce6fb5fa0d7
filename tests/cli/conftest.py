"""A real runs folder written by CheckpointManager, and a runner for the real console script."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, parse_config

MITHRIL = Path(sys.executable).parent / "mithril"


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 64)
        self.lin = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 300)


@dataclass
class Runs:
    root: Path  # the runs folder
    run: Path  # runs/run1
    model: Tiny
    steps: list[int]


def make_runs(tmp: Path, steps: tuple[int, ...] = (1, 2, 3), *, delta: bool = False) -> Runs:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp / "runs"}"\nrun_id = "run1"\n'
                       'ckpting_save_iter = 1\nbest_metric_name = "loss"\n'
                       f"[checkpointing.compression]\ndelta = {str(delta).lower()}\n")
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as mgr:
        for s in steps:
            loss = model.head(model.lin(model.emb(torch.arange(8)))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.save_nowait(s, metrics={"loss": 10.0 - s if s != 2 else 0.5})
            mgr.wait()
    return Runs(tmp / "runs", tmp / "runs" / "run1", model, list(steps))


@pytest.fixture
def runs(tmp_path: Path) -> Runs:
    return make_runs(tmp_path)


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def mithril(*args: str | Path) -> Result:
    """Run the installed console script (what a user runs), not an in-process main()."""
    p = subprocess.run([str(MITHRIL), *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    return Result(p.returncode, p.stdout, p.stderr)
