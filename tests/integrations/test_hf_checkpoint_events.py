"""What the Trainer callback reports (save results through ``trainer.log``) and how it meets
a preemption signal during ``trainer.train()`` (a real SIGTERM, in a process of its own)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from mithril_async.errors import SaveFailed  # noqa: E402
from mithril_async.integrations.hf_trainer import MithrilTrainerCallback  # noqa: E402
from mithril_async.storage.local import LocalStore  # noqa: E402
from tests.integrations._hf_tiny import SIGNAL_AT, Signaller, trainer  # noqa: E402

ROOT = Path(__file__).parents[2]
KEYS = {"checkpoint/step", "checkpoint/stall_ms", "checkpoint/total_s", "checkpoint/ratio",
        "checkpoint/bytes"}


class Logged(transformers.TrainerCallback):
    """Placed before ours: sees every ``on_log`` as a report_to integration would."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and any(k.startswith("checkpoint/") for k in logs):
            self.logs.append(dict(logs))


def _checkpoint_entries(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in history if "checkpoint/step" in e]


def test_save_results_reach_the_trainers_loggers(tmp_path: Path) -> None:
    seen = Logged()
    cb = MithrilTrainerCallback(tmp_path / "runs", run_id="hf-log", every_n_steps=2)
    t = trainer(tmp_path / "out", [seen, cb], steps=4)
    t.train()
    entries = _checkpoint_entries(t.state.log_history)
    assert [e["checkpoint/step"] for e in entries] == [2.0, 4.0]
    assert [e["checkpoint/step"] for e in seen.logs] == [2.0, 4.0]  # through trainer.log
    for e in entries:
        assert e.keys() >= KEYS
        assert e["checkpoint/bytes"] > 0 and e["checkpoint/ratio"] > 0
        assert e["checkpoint/total_s"] * 1e3 >= e["checkpoint/stall_ms"] > 0
    on_disk = [json.loads((v / "manifest.json").read_text())["step"]
               for v in sorted((tmp_path / "runs" / "hf-log" / "versions").iterdir())]
    assert on_disk == [2, 4]


def test_a_failed_save_reaches_the_trainers_log_and_the_python_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    put = LocalStore.put

    async def failing_put(self: LocalStore, key: str, data: Any) -> None:
        if "/v000002/" in key:
            raise OSError(28, f"No space left on device (injected) writing {key}")
        await put(self, key, data)

    monkeypatch.setattr(LocalStore, "put", failing_put)
    # the fault is patched into this process's LocalStore: the saves must run here
    cb = MithrilTrainerCallback(tmp_path / "runs", run_id="hf-fail", every_n_steps=2,
                                config={"pipeline": {"process": "inline"}})
    t = trainer(tmp_path / "out", [cb], steps=4)
    with caplog.at_level(logging.ERROR, logger="mithril_async"), \
            pytest.raises(SaveFailed, match="injected"):
        t.train()  # the last save failed: raised at the end of training, never swallowed
    entries = _checkpoint_entries(t.state.log_history)
    assert [(e["checkpoint/step"], e.get("checkpoint/failed")) for e in entries] == [
        (2.0, None), (4.0, 1.0)]
    assert any(r.levelno == logging.ERROR and "step 4" in r.getMessage()
               for r in caplog.records)


def test_sigterm_during_train_saves_the_step_and_the_process_ends_by_it(tmp_path: Path
                                                                         ) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "tests.integrations._hf_tiny", str(out),
                            str(tmp_path / "runs")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == -signal.SIGTERM, child.stderr[-4000:]
    versions = sorted((tmp_path / "runs" / "preempt" / "versions").iterdir())
    assert [json.loads((v / "manifest.json").read_text())["step"] for v in versions] == [
        SIGNAL_AT]  # the step the signal came at, and no other
    assert (out / f"step-{SIGNAL_AT}").exists() and not (out / "step-200").exists()


def test_with_exit_after_false_training_stops_after_the_signals_save(tmp_path: Path) -> None:
    heard: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: heard.append(signum))
    try:
        cb = MithrilTrainerCallback(tmp_path / "runs", run_id="stop", every_n_steps=1000,
                                    config={"save_on_signals": ["SIGUSR1"],
                                            "exit_after_signal_save": False})
        t = trainer(tmp_path, [Signaller(tmp_path, signal.SIGUSR1, released=lambda: (
            cb.manager is not None and cb.manager.preempted)), cb], steps=200)
        t.train()  # returns: the callback stopped training once the save was durable
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert SIGNAL_AT < t.state.global_step < 200 and heard == []  # consumed, not delivered
    assert [e["checkpoint/step"] for e in _checkpoint_entries(t.state.log_history)] == [
        float(SIGNAL_AT)]
    (version,) = (tmp_path / "runs" / "stop" / "versions").iterdir()
    assert json.loads((version / "manifest.json").read_text())["step"] == SIGNAL_AT
