"""Exact resume on the device: 8 steps straight == 4 steps, SIGKILL, restore('latest'),
4 steps, bit for bit (weights, AdamW state, device RNG, data position), in both snapshot
modes. The CPU version is tests/manager/test_resume.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.manager.conftest import state_equal

from ._helpers import CUDA_ONLY

pytestmark = CUDA_ONLY
ROOT = Path(__file__).parents[2]


def _run(mode: str, runs: Path, out: Path, snapshot: str = "blocking"
         ) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return subprocess.run([sys.executable, "-m", "tests.gpu._resume_cuda", mode, str(runs),
                           "8", str(out), snapshot], cwd=ROOT, env=env, capture_output=True,
                          timeout=300)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """8 steps without a crash, twice: training itself must be bit-reproducible here."""
    tmp = tmp_path_factory.mktemp("straight")
    for name in ("a", "again"):
        done = _run("straight", tmp / name, tmp / f"{name}.pt")
        assert done.returncode == 0, done.stderr.decode()
    a, again = torch.load(tmp / "a.pt"), torch.load(tmp / "again.pt")
    assert state_equal(a["model"], again["model"]), "training is not deterministic here"
    return a


@pytest.mark.parametrize("snapshot", ["blocking", "overlapped"])
def test_killed_run_resumes_bit_identically_on_the_device(
        tmp_path: Path, snapshot: str, straight: dict[str, Any]) -> None:
    crash = _run("crash", tmp_path / "b", tmp_path / "unused.pt", snapshot)
    assert crash.returncode == -signal.SIGKILL, crash.stderr.decode()
    assert not (tmp_path / "unused.pt").exists()
    resumed = _run("resume", tmp_path / "b", tmp_path / "resumed.pt", snapshot)
    assert resumed.returncode == 0, resumed.stderr.decode()
    b = torch.load(tmp_path / "resumed.pt")
    assert state_equal(straight["model"], b["model"])
    assert state_equal(straight["opt"], b["opt"])
    manifest = (tmp_path / "b" / "resume" / "versions" / "v000001" / "manifest.json").read_text()
    assert '"exact": true' in manifest
