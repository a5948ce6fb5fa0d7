"""Every script in examples/ runs to a successful end (the README's main job among them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("script", "args"), [
    ("train_loop.py", ["--steps", "20"]),
    ("s3_demo.py", ["--steps", "20", "--mode", "remote_only"]),
])
def test_example_runs(script: str, args: list[str], tmp_path: Path) -> None:
    extra = ["--runs", str(tmp_path)] if script == "train_loop.py" else []
    # the real default (the suite's conftest sets MITHRIL_PROCESS=inline for itself)
    env = {k: v for k, v in os.environ.items() if k != "MITHRIL_PROCESS"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args, *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "weights identical to the live model: True" in proc.stdout
    assert "resumed from latest = step 20" in proc.stdout
    if script == "train_loop.py":
        assert "saves ran in a checkpoint worker process" in proc.stdout
    if script == "s3_demo.py":
        assert "committed versions: v000001, v000002" in proc.stdout
