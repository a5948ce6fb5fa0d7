"""Exact resume: N steps straight == N/2 steps, SIGKILL, restore('latest'), N/2 steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.manager.conftest import state_equal

ROOT = Path(__file__).parents[2]


def _run(mode: str, runs: Path, out: Path, snapshot: str = "blocking"
         ) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tests.manager._resume_script", mode, str(runs),
                           "8", str(out), snapshot], cwd=ROOT, env=env, capture_output=True,
                          timeout=300)


@pytest.mark.parametrize("snapshot", ["blocking", "overlapped"])
def test_killed_run_resumes_bit_identically(tmp_path: Path, snapshot: str) -> None:
    straight = _run("straight", tmp_path / "a", tmp_path / "straight.pt")
    assert straight.returncode == 0, straight.stderr.decode()
    crash = _run("crash", tmp_path / "b", tmp_path / "unused.pt", snapshot)
    assert crash.returncode == -signal.SIGKILL, crash.stderr.decode()
    assert not (tmp_path / "unused.pt").exists()
    resumed = _run("resume", tmp_path / "b", tmp_path / "resumed.pt", snapshot)
    assert resumed.returncode == 0, resumed.stderr.decode()
    a = torch.load(tmp_path / "straight.pt")
    b = torch.load(tmp_path / "resumed.pt")
    assert state_equal(a["model"], b["model"])
    assert state_equal(a["opt"], b["opt"])
    manifest = (tmp_path / "b" / "resume" / "versions" / "v000001" / "manifest.json").read_text()
    assert '"exact": true' in manifest
