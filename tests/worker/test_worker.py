"""Saves whose background part runs in a checkpoint worker process (``process = "worker"``).

Real processes and real signals: the worker is the process the manager starts; the trainer is
this test process or a child script; kills are SIGKILLs, and which point of a save a kill
lands at is fixed by what is on disk (a claim without a manifest), never by timing.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, ConfigError
from mithril_async.config import config_from_dict
from mithril_async.errors import SaveFailed, WorkerExited
from mithril_async.storage.local import LocalStore
from tests.ranks import launch_ranks
from tests.worker._procs import gone
from tests.worker._state import holds_step, make_model, set_step

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _cfg(runs: Path, run_id: str = "w", **pipeline: Any) -> Any:
    pipe = {"process": "worker", **pipeline}
    return config_from_dict({"checkpointing": {"runs_path": str(runs), "run_id": run_id,
                                               "pipeline": pipe,
                                               "compression": {"delta": True}}})








def _memfds(pid: int) -> list[str]:
    """The shared staging segments process ``pid`` maps (memfd, no file-system name)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line for line in f if "memfd:mithril" in line]
    except FileNotFoundError:
        return []


def test_saves_run_in_a_worker_process_and_restore_exactly(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = _cfg(tmp_path / "runs", snapshot="overlapped")
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as mgr:
        assert mgr.process == "worker"
        for step in (1, 2, 3):
            set_step(model, step)
            res = mgr.save_nowait(step).result()
            assert res.status == "committed" and res.version_id == f"v{step:06d}"
            assert res.bytes_out > 0 and res.total_s > 0
        pid = mgr.worker_pid
        assert pid is not None and pid != os.getpid()
        assert _memfds(pid)  # it reads the snapshot from shared memory
        assert [r.status for r in mgr.history] == ["committed"] * 3
    assert gone(pid)  # close() waited for the worker to exit
    fresh = make_model()
    with CheckpointManager(_cfg(tmp_path / "runs"), {"model": fresh}) as mgr:
        assert mgr.restore_sync("latest") == 3
        assert holds_step(fresh, 3)
        assert mgr.restore_sync(2) == 2 and holds_step(fresh, 2)  # a delta of v1


def test_a_trainer_killed_after_save_nowait_leaves_the_worker_to_commit(
        tmp_path: Path) -> None:
    """The trainer SIGKILLs itself right after ``save_nowait`` returned: its worker finishes
    that save, commits it, and exits; a fresh process restores it bit for bit. The trainer
    is a script without a main guard (the worker never imports it)."""
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(HERE / "_trainer.py"), "kill-after-save",
                           str(runs)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    lines = proc.stdout.split()
    assert "saved" in lines and lines[-1] == "2"
    worker = int(lines[lines.index("worker") + 1])
    assert gone(worker), "the worker outlived its trainer past the save"
    fresh = make_model()
    with CheckpointManager(_cfg(runs), {"model": fresh}) as mgr:
        assert mgr.restore_sync("latest") == 2
    assert holds_step(fresh, 2)


def test_a_script_without_a_main_guard_saves_through_a_worker(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(HERE / "_trainer.py"), "train",
                           str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "restored 3" in proc.stdout
    pids = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("worker")}
    assert len(pids) == 1  # one worker served every save


def test_a_worker_killed_mid_save_fails_that_save_typed_and_the_next_one_commits(
        tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    big = torch.nn.Linear(2048, 2048)  # enough bytes that a save takes a while to encode
    model = make_model()
    state = {"model": model, "big": big}
    with CheckpointManager(_cfg(runs), state) as mgr:
        set_step(model, 1)
        assert mgr.save_nowait(1).result().status == "committed"
        killed = None
        for step in (2, 3, 4, 5):  # until a kill lands between the claim and the manifest
            set_step(model, step)
            with torch.no_grad():
                big.weight.add_(1.0)
            pid = mgr.worker_pid
            assert pid is not None
            handle = mgr.save_nowait(step)
            vdir = runs / "w" / "versions" / f"v{step:06d}"
            while not (vdir / "_claim.json").exists() and not handle.done():
                time.sleep(0.0005)
            os.kill(pid, signal.SIGSTOP)
            if (vdir / "manifest.json").exists():  # it finished first: let it go on
                os.kill(pid, signal.SIGCONT)
                handle.result()
                continue
            os.kill(pid, signal.SIGKILL)
            killed = step
            break
        assert killed is not None, "no kill landed mid-save"
        with pytest.raises(SaveFailed) as err:
            mgr.wait()
        assert isinstance(err.value.__cause__, WorkerExited)
        assert "SIGKILL" in str(err.value.__cause__) and str(pid) in str(err.value.__cause__)
        assert mgr.history[-1].status == "failed"
        assert not (runs / "w" / "versions" / f"v{killed:06d}" / "manifest.json").exists()
        set_step(model, 9)
        res = mgr.save_nowait(9).result()  # a new worker
        assert res.status == "committed" and mgr.worker_pid not in (None, pid)
    fresh = make_model()
    with CheckpointManager(_cfg(runs), {"model": fresh, "big": torch.nn.Linear(2048, 2048)}
                           ) as mgr:
        assert mgr.restore_sync("latest") == 9
        assert holds_step(fresh, 9)
        assert mgr.restore_sync(killed - 1) == killed - 1  # the last good one before it


def test_two_managers_in_one_process_have_a_worker_each(tmp_path: Path) -> None:
    a, b = make_model(), make_model()
    with CheckpointManager(_cfg(tmp_path / "a", "a"), {"model": a}) as ma, \
            CheckpointManager(_cfg(tmp_path / "b", "b"), {"model": b}) as mb:
        set_step(a, 1)
        set_step(b, 2)
        ha, hb = ma.save_nowait(1), mb.save_nowait(2)
        assert ha.result().status == hb.result().status == "committed"
        assert ma.worker_pid != mb.worker_pid
    for runs, rid, step in ((tmp_path / "a", "a", 1), (tmp_path / "b", "b", 2)):
        fresh = make_model()
        with CheckpointManager(_cfg(runs, rid), {"model": fresh}) as m:
            assert m.restore_sync("latest") == step
        assert holds_step(fresh, step)


def test_the_process_setting_is_checked_and_what_a_worker_cannot_serve_runs_inline(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With "worker" only the default, a configuration a worker cannot serve runs inline and
    the log says why."""
    with pytest.raises(ConfigError, match="process"):
        config_from_dict({"checkpointing": {"pipeline": {"process": "thread"}}})
    assert config_from_dict({"checkpointing": {}}).checkpointing.pipeline.process == "inline"
    monkeypatch.setenv("MITHRIL_PROCESS", "worker")
    default = config_from_dict({"checkpointing": {"runs_path": str(tmp_path / "runs"),
                                                  "run_id": "w"}})
    assert default.checkpointing.pipeline.process == "worker"
    model = make_model()
    caplog.set_level(logging.INFO, logger="mithril_async")
    with CheckpointManager(default, {"model": model},
                           store=LocalStore(tmp_path), runs_prefix="runs") as mgr:
        assert mgr.process == "inline" and mgr.worker_pid is None
        set_step(model, 1)
        assert mgr.save_nowait(1).result().status == "committed"
    assert "a store was passed to the manager" in caplog.text
    lossy = config_from_dict({"checkpointing": {
        "runs_path": str(tmp_path / "l"), "lossy": {"enabled": True}}})
    with CheckpointManager(lossy, {"model": model}) as mgr:
        assert mgr.process == "worker"  # the worker runs the lossy coder too
    streamed = config_from_dict({"checkpointing": {
        "runs_path": str(tmp_path / "s"), "run_id": "s", **_STREAMED}})
    with CheckpointManager(streamed, {"model": _big_state()}) as mgr:
        assert mgr.process == "worker"
        res = mgr.save_nowait(1).result()
        assert res.streamed and res.status == "committed"
    assert "runs in the training process" not in caplog.text  # the worker encoded it


#: a budget the state of :func:`_big_state` (12 MiB) does not fit staged: its saves stream
_STREAMED: dict[str, Any] = {"compression": {"chunk_mib": 0.5, "threads": 1},
                             "pipeline": {"host_memory_mib": 8}}


def _big_state() -> Any:
    from mithril_async import TensorDict

    g = torch.Generator().manual_seed(0)
    return TensorDict({f"t{i}": torch.randn(1 << 18, generator=g) for i in range(12)})


def test_an_explicit_worker_refuses_what_a_worker_cannot_serve(tmp_path: Path) -> None:
    """``process = "worker"`` set in the configuration is never silently run inline: each
    configuration a worker cannot serve is a ConfigError naming it and the key, before
    anything is started."""
    from mithril_async.retention import KeepLastN

    def cfg(**ck: Any) -> Any:
        pipe = {"process": "worker", **ck.pop("pipeline", {})}
        return config_from_dict({"checkpointing": {"runs_path": str(tmp_path / "runs"),
                                                   "run_id": "x", "pipeline": pipe, **ck}})

    threads = {t.ident for t in threading.enumerate()}
    model = make_model()
    refused = [
        (cfg(), {"store": LocalStore(tmp_path), "runs_prefix": "runs"}, "a store"),
        (cfg(), {"retention": KeepLastN(2)}, "a retention policy"),
    ]
    for config, kw, what in refused:
        with pytest.raises(ConfigError, match=rf'process = "worker" is set, but .*{what}'):
            CheckpointManager(config, {"model": model}, **kw)
    assert {t.ident for t in threading.enumerate()} <= threads  # nothing was started
    assert not (tmp_path / "runs").exists() and not (tmp_path / "node").exists()
    # a save streamed under host_memory_mib is the worker's too (tests/worker/test_streamed.py)
    with CheckpointManager(cfg(**_STREAMED), {"model": _big_state()}) as mgr:
        assert mgr.process == "worker"
        res = mgr.save_nowait(1).result()
        assert res.streamed and res.status == "committed" and mgr.all_steps() == [1]


_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.worker._ranks"])


def test_two_ranks_commit_through_workers_and_a_dead_worker_fails_both_promptly(
        tmp_path: Path) -> None:
    from tests.worker._ranks import run_rank

    codes = launch_ranks(_CTX, run_rank, 2, lambda rank, port: (str(tmp_path), rank, 2, port),
                         timeout=240, name="worker")
    assert codes == [0, 0]
    seen = [json.loads((tmp_path / f"ok_rank{r}").read_text()) for r in range(2)]
    assert seen[1]["save2"].startswith("WorkerExited")
    assert seen[0]["save2"] != "committed" and "rank 1" in seen[0]["save2"]
    for s in seen:
        assert s["save3"] == "committed" and s["restored"] == 3 and s["exact"]
    assert seen[1]["new_worker"] and not seen[0]["new_worker"]


def test_the_workers_log_and_its_errors_details_reach_the_trainer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A held version's warning is logged by the worker and reaches the trainer's logging
    (its handlers, here pytest's); a failed save's NonFiniteState keeps its counts."""
    from mithril_async.errors import NonFiniteState

    model = make_model()
    runs = tmp_path / "runs"
    hold = config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "hold", "pipeline": {"process": "worker"}}})
    with CheckpointManager(hold, {"model": model}) as mgr:
        assert mgr.save_nowait(1).result().status == "committed"
        pid = mgr.worker_pid
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
        with caplog.at_level(logging.WARNING, "mithril_async"):
            res = mgr.save_nowait(2).result()
        assert res.held and mgr.worker_pid == pid  # saved by the worker, not inline
    warned = [r for r in caplog.records if "v000002" in r.getMessage()
              and r.name == "mithril_async" and r.process == os.getpid()]
    assert warned and "NaN" in warned[0].getMessage()
    fail = config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "fail", "nonfinite": "fail",
        "pipeline": {"process": "worker"}}})
    with CheckpointManager(fail, {"model": model}) as mgr:
        with pytest.raises(NonFiniteState) as err:
            mgr.save_nowait(1).result()
        assert mgr.worker_pid is not None
        name = next(n for n, _ in model.named_parameters())
        assert err.value.tensors == {f"model/{name}": (1, 0)}
        with pytest.raises(SaveFailed):
            mgr.check_for_errors()
