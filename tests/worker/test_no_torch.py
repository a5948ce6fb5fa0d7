"""The checkpoint worker encodes bytes from shared memory and never loads torch.

torch is most of a Python process's memory (its libraries alone are far more than the
worker's budget) and most of its start-up. These tests check what the worker process loads,
from its memory map, after saves that take every path of the encoder: float, bfloat16,
complex and integer tensors, an empty one, NaN counted under ``nonfinite = "hold"``, delta
chains with deduplicated tensors, an overlapped snapshot, and compression off (a plain
safetensors blob).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, TensorDict
from mithril_async.config import config_from_dict
from tests.worker._procs import gone

ROOT = Path(__file__).parent.parent.parent

#: the worker's own memory (private and file-backed; the shared staging excluded) stays
#: under this: the target for a worker a node runs once per rank
OWN_RSS_LIMIT_KIB = 100 * 1024


def _cfg(runs: Path, **extra: Any) -> Any:
    pipeline = extra.pop("pipeline", {})
    return config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "nt", "nonfinite": "hold",
        "pipeline": {"process": "worker", **pipeline}, **extra}})


def _state(complex_: bool = True) -> dict[str, Any]:
    """``complex_``: with a complex tensor (safetensors, the uncompressed format, has none)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    extra = TensorDict({
        "bf16": torch.randn(17, 5).bfloat16(),
        "ints": torch.arange(40, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "frozen": torch.randn(64),  # never changes: deduplicated after the first save
    })
    if complex_:
        extra.tensors["complex"] = torch.zeros(6, dtype=torch.complex64)
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters()),
            "extra": extra}


def _train(state: dict[str, Any], step: int) -> None:
    model, opt = state["model"], state["optimizer"]
    opt.zero_grad()
    model(torch.full((3, 32), float(step))).square().sum().backward()
    opt.step()
    extra = state["extra"].tensors
    extra["bf16"].fill_(step)
    if step == 2:  # NaN counted (in one component of a complex number): the version held
        extra["bf16"][3, 1] = float("nan")
    if "complex" in extra:
        extra["complex"].fill_(complex(step, -step))
        if step == 2:
            extra["complex"][4] = complex(float("nan"), 1.0)


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _own_rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` that is its own: anonymous and file-backed pages (the
    shared staging segments, ``RssShmem``, are the trainer's)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) for k in ("RssAnon", "RssFile"))


def test_importing_the_worker_loads_no_torch() -> None:
    code = ("import sys, mithril_async.worker.server, mithril_async.worker.__main__; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("settings", [
    pytest.param({"compression": {"delta": True}}, id="delta-chains"),
    pytest.param({"compression": {"delta": True}, "pipeline": {"snapshot": "overlapped"}},
                 id="overlapped"),
    pytest.param({"compression": {"enabled": False}}, id="uncompressed"),
])
def test_the_worker_saves_every_kind_of_tensor_without_torch(
        tmp_path: Path, settings: dict[str, Any]) -> None:
    compressed = settings["compression"].get("enabled", True)
    state = _state(compressed)
    with CheckpointManager(_cfg(tmp_path / "runs", **settings), state) as mgr:
        assert mgr.process == "worker"
        statuses = []
        for step in (1, 2, 3):
            _train(state, step)
            res = mgr.save_nowait(step).result()
            statuses.append("held" if res.held else res.status)
        pid = mgr.worker_pid
        assert pid is not None
        maps = _maps(pid)
        assert "libtorch" not in maps, "the worker loaded torch"
        assert "memfd:mithril" in maps  # it read the snapshots from shared memory
        assert _own_rss_kib(pid) <= OWN_RSS_LIMIT_KIB
        saved = {k: v.clone() for k, v in state["extra"].tensors.items()}
        weights = {k: v.clone() for k, v in state["model"].state_dict().items()}
    assert gone(pid)
    # step 2 holds a NaN: held (committed, no alias moved); 1 and 3 are clean
    assert statuses == ["committed", "held", "committed"]
    fresh = _state(compressed)
    with CheckpointManager(_cfg(tmp_path / "runs", **settings), fresh) as mgr:
        assert mgr.restore_sync(3) == 3
    for name, value in saved.items():
        got = fresh["extra"].tensors[name]
        assert got.dtype == value.dtype and torch.equal(got, value), name
    for name, value in fresh["model"].state_dict().items():
        assert torch.equal(value, weights[name]), name
