"""A job restarted with the same configuration resumes where it stopped, without a run_id.

The README's quickstart (its synchronous loop with configs/train.toml, which sets no
``run_id``), run twice in one folder as a newcomer would, in real processes with the default
process mode: the second run continues the first's run from its latest version. Also: an
explicit ``run_id`` keeps its meaning, ``new_run = true`` starts a fresh run without touching
the earlier one, a step the continued run already has is refused with a message that says
why, a damaged current-run record is an error naming it, and two ranks agree on the run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mithril_async import CheckpointManager, ConfigError, TensorDict
from mithril_async.config import config_from_dict
from mithril_async.current_run import CURRENT_RUN_FILE
from mithril_async.errors import InvalidFormat, StepAlreadyExists
from tests.manager._run_id_rank import run_rank
from tests.ranks import launch_ranks

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.manager._run_id_rank"])
ROOT = Path(__file__).resolve().parents[2]

HARNESS = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
calls = []
v = 1.0

def train_step():
    calls.append(1)
    loss = model(torch.randn(4, 8)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

{quickstart}

train_sync(int(sys.argv[1]))
print("TRAINED", len(calls))
"""


def _quickstart() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quickstart", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _run_quickstart(folder: Path, steps: int) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MITHRIL_PROCESS"}  # the real default
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "quickstart.py", str(steps)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    return int(re.findall(r"TRAINED (\d+)", done.stdout)[-1])


def test_the_quickstart_run_twice_resumes_its_run(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "train.toml", tmp_path / "configs" / "train.toml")
    assert "run_id" not in (tmp_path / "configs" / "train.toml").read_text()
    (tmp_path / "quickstart.py").write_text(HARNESS.format(quickstart=_quickstart()))
    assert _run_quickstart(tmp_path, 20) == 20  # a fresh folder: steps 1..20, saves at 10, 20
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1
    record = json.loads((tmp_path / "runs" / CURRENT_RUN_FILE).read_text())
    assert record["run_id"] == runs[0].name
    assert _run_quickstart(tmp_path, 30) == 10  # restarted: resumes at 21
    assert [p for p in (tmp_path / "runs").iterdir() if p.is_dir()] == runs
    latest = json.loads((runs[0] / "aliases" / "latest.json").read_text())
    assert latest["step"] == 30


def _cfg(runs: Path, **top: object) -> object:
    return config_from_dict({"checkpointing": {"runs_path": str(runs), **top,
                                               "pipeline": {"process": "inline"}}})


def _state(value: float) -> dict[str, TensorDict]:
    return {"model": TensorDict({"w": torch.full((4,), value)})}


def test_explicit_run_id_new_run_and_a_step_the_run_has(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with CheckpointManager(_cfg(runs), _state(1.0)) as m:
        first = m.run_id
        m.save_nowait(1)
    with CheckpointManager(_cfg(runs), _state(2.0)) as m:
        assert m.run_id == first and m.latest_step() == 1
        with pytest.raises(StepAlreadyExists, match="new_run = true"):
            m.save_nowait(1)
        m.save_nowait(2)
    with CheckpointManager(_cfg(runs, new_run=True), _state(3.0)) as m:
        fresh = m.run_id
        assert fresh != first and m.latest_step() is None
        m.save_nowait(1)  # a new run: step 1 again, the earlier run untouched
    with CheckpointManager(_cfg(runs), _state(0.0)) as m:
        assert m.run_id == fresh  # new_run made it the current run
    with CheckpointManager(_cfg(runs, run_id=first), _state(0.0)) as m:
        assert m.latest_step() == 2  # an explicit id names its run
        state = m.state
        m.restore_sync("latest")
        assert torch.equal(state["model"].state_dict()["w"], torch.full((4,), 2.0))
    record = json.loads((runs / CURRENT_RUN_FILE).read_text())
    assert record["run_id"] == fresh  # an explicit run_id never moves the record


def test_new_run_with_a_run_id_is_refused() -> None:
    with pytest.raises(ConfigError, match="new_run"):
        config_from_dict({"checkpointing": {"run_id": "a", "new_run": True}})


def test_a_damaged_record_is_an_error_naming_it(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / CURRENT_RUN_FILE).write_text('{"run_id": "../escape"}')
    with pytest.raises(InvalidFormat, match=CURRENT_RUN_FILE):
        CheckpointManager(_cfg(runs), _state(1.0))
    (runs / CURRENT_RUN_FILE).write_bytes(b"x" * (1 << 20))
    with pytest.raises(InvalidFormat, match="implausibly large"):
        CheckpointManager(_cfg(runs), _state(1.0))
    with CheckpointManager(_cfg(runs, new_run=True), _state(1.0)) as m:
        m.save_nowait(1)  # the way out the error names
    assert json.loads((runs / CURRENT_RUN_FILE).read_text())["run_id"] == m.run_id


def test_two_ranks_agree_on_the_current_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / CURRENT_RUN_FILE).write_text(json.dumps(
        {"schema_version": 1, "run_id": "earlier-run", "started_at": "2026-01-01T00:00:00"}))
    codes = launch_ranks(_CTX, run_rank, 2, lambda rank, port: (str(runs), rank, 2, port), 180)
    assert codes == [0, 0]
    assert [(tmp_path / "runs" / f"rank{r}.txt").read_text() for r in range(2)] == [
        "earlier-run", "earlier-run"]
