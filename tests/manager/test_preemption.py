"""A preemption signal becomes a save (``save_on_signals``).

Real processes get a real SIGTERM mid-loop: the save lands at the next step boundary,
restores exactly in a fresh process, and the process still ends killed by SIGTERM; a loop that
never asks for a save still ends by the signal once the grace runs out. In this process
(pytest runs tests on the main thread) SIGUSR1 with a recording handler installed before the
manager shows the chaining, ``exit_after_signal_save = false``, a second signal and close.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

from mithril_async import CheckpointManager, Config, SaveResult, parse_config
from mithril_async.errors import ConfigError
from tests.manager._preempt_child import GATE
from tests.manager.conftest import make_state, state_equal, train_step
from tests.manager.test_listeners import GatedStore

ROOT = Path(__file__).parents[2]


class Previous:
    """The SIGUSR1 handler a program had before the manager: records who called it when."""

    def __init__(self, heard: list[tuple[int, str]]) -> None:
        self.calls: list[tuple[int, list[tuple[int, str]]]] = []
        self.called = threading.Event()
        self.heard = heard

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append((signum, list(self.heard)))  # what listeners had heard by then
        self.called.set()


@pytest.fixture
def previous() -> Iterator[Previous]:
    old = signal.getsignal(signal.SIGUSR1)
    prev = Previous([])
    signal.signal(signal.SIGUSR1, prev)
    yield prev
    signal.signal(signal.SIGUSR1, old)


def _config(tmp: Path, **ck: object) -> Config:
    return Config.model_validate({"checkpointing": {
        "runs_path": str(tmp / "runs"), "run_id": "preempt", "ckpting_save_iter": 1000, **ck}})


def _manager(tmp: Path, heard: list[tuple[int, str]], **ck: object) -> CheckpointManager:
    """A manager saving every 1000 steps, with SIGUSR1 a save; listeners record to ``heard``."""
    model, opt, _ = make_state()

    def hear(res: SaveResult) -> None:
        heard.append((res.step, res.status))

    return CheckpointManager(_config(tmp, save_on_signals=["SIGUSR1"], **ck),
                             {"model": model, "optimizer": opt}, on_result=hear)


def test_signal_asks_for_a_save_and_the_previous_handler_runs_once_it_is_durable(
        tmp_path: Path, previous: Previous) -> None:
    mgr = _manager(tmp_path, previous.heard)
    assert signal.getsignal(signal.SIGUSR1) != previous
    assert not mgr.should_save(1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert mgr.should_save(2) and mgr.should_save(2)  # until a save is asked for
    assert previous.calls == []  # held back while the save is pending
    mgr.save_nowait(2)
    assert previous.called.wait(60)
    assert previous.calls == [(signal.SIGUSR1, [(2, "committed")])]  # after the durable save
    assert not mgr.should_save(3) and not mgr.preempted
    mgr.close()
    assert signal.getsignal(signal.SIGUSR1) is previous  # ours removed on close


def test_exit_after_false_sets_preempted_and_a_second_signal_is_not_held(
        tmp_path: Path, previous: Previous) -> None:
    mgr = _manager(tmp_path, previous.heard, exit_after_signal_save=False)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert mgr.should_save(5)
    mgr.save_nowait(5)
    mgr.wait()  # the result (and what follows it) has been delivered
    assert mgr.preempted and previous.calls == []  # the loop decides, nothing delivered
    os.kill(os.getpid(), signal.SIGUSR1)  # a new signal: a new save
    assert mgr.should_save(6)
    os.kill(os.getpid(), signal.SIGUSR1)  # a second one while it is pending: at once
    assert previous.called.wait(60)
    assert [s for s, _ in previous.calls] == [signal.SIGUSR1]
    mgr.close()


def test_no_save_asked_for_within_the_grace_delivers_the_signal(
        tmp_path: Path, previous: Previous) -> None:
    mgr = _manager(tmp_path, previous.heard, signal_grace_s=0.05)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert previous.called.wait(60)  # should_save was never called
    assert mgr.preemption is not None and mgr.preemption.grace_expired
    mgr.close()
    assert previous.heard == [] and [s for s, _ in previous.calls] == [signal.SIGUSR1]


def test_a_skipped_save_asks_again(tmp_path: Path, previous: Previous) -> None:
    store = GatedStore()
    model, _, _ = make_state()
    mgr = CheckpointManager(_config(tmp_path, save_on_signals=["SIGUSR1"],
                                    pipeline={"on_busy": "skip"}),
                            {"model": model}, store=store)
    held = mgr.save_nowait(1)  # still in flight when the signal's save is asked for
    os.kill(os.getpid(), signal.SIGUSR1)
    assert mgr.should_save(2)
    assert mgr.save_nowait(2).skipped
    assert mgr.should_save(3)  # asked again
    store.gate.set()
    held.result()
    mgr.save_nowait(3)
    assert previous.called.wait(60)
    assert mgr.all_steps() == [1, 3]
    mgr.close()


def test_close_delivers_a_signal_not_acted_on(tmp_path: Path, previous: Previous) -> None:
    mgr = _manager(tmp_path, previous.heard)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert previous.calls == []
    mgr.close()  # the loop ended without asking: the signal takes effect now
    assert [s for s, _ in previous.calls] == [signal.SIGUSR1]


def test_only_the_main_thread_installs_handlers(tmp_path: Path) -> None:
    cfg = _config(tmp_path, save_on_signals=["SIGUSR1"])
    model, _, _ = make_state()
    errors: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(cfg, {"model": model}).close()
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=make, name="worker")
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "save_on_signals" in str(errors[0]) and "'worker'" in str(errors[0])
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


@pytest.mark.parametrize(("value", "match"), [
    ('["SIGTERM", "SIGBOGUS"]', "not a signal name"),
    ('["SIGKILL"]', "cannot be caught"),
    ('["SIGCHLD"]', "does not end a process"),
    ('["SIGTERM", "SIGTERM"]', "named twice"),
])
def test_signal_names_are_checked(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=rf"save_on_signals.*{match}"):
        parse_config(f"[checkpointing]\nsave_on_signals = {value}\n")


# ---------------------------------------------------------------------------- real processes
def _child(mode: str, tmp: Path) -> tuple[int, list[str], str]:
    """Run the child to the gate, SIGTERM it there, let it go on; its exit status, its
    stdout lines after the gate and its stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-m", "tests.manager._preempt_child", mode,
                              str(tmp / "runs"), str(tmp)], cwd=ROOT, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        for line in child.stdout:
            if line.strip() == "gate":
                break
        child.send_signal(signal.SIGTERM)  # held at the gate: between step GATE and GATE+1
        child.stdin.write("go\n")
        child.stdin.flush()
        after, err = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, after.splitlines(), err


def test_sigterm_mid_loop_saves_the_next_step_restores_exactly_and_exits_by_it(
        tmp_path: Path) -> None:
    code, after, err = _child("save", tmp_path)
    assert code == -signal.SIGTERM, err  # as without us, once the save was durable
    assert after[0] == f"step {GATE + 1}", after
    saved = torch.load(tmp_path / "saved.pt")
    assert (saved["step"], saved["status"]) == (GATE + 1, "committed")  # the next boundary
    # a fresh process (this one) restores the very state the child had at that step
    cfg = _config(tmp_path)
    model, opt, batcher = make_state(seed=99)
    train_step(model, opt, batcher)  # other weights and optimizer state than the saved ones
    with CheckpointManager(cfg, {"model": model, "optimizer": opt, "batcher": batcher}) as m:
        assert m.all_steps() == [GATE + 1]
        assert m.restore_sync("latest") == GATE + 1
    assert state_equal(model.state_dict(), saved["model"])
    assert state_equal(opt.state_dict(), saved["optimizer"])
    assert batcher.get_state() == saved["batcher"]


def test_a_loop_that_never_asks_still_ends_by_the_signal(tmp_path: Path) -> None:
    code, after, err = _child("grace", tmp_path)
    assert code == -signal.SIGTERM, err
    assert f"step {GATE + 1}" in after  # the loop went on after the signal: it was held
    assert "no save was asked for within signal_grace_s" in err  # and the grace released it
    assert not (tmp_path / "runs" / "preempt" / "versions").exists() or not list(
        (tmp_path / "runs" / "preempt" / "versions").iterdir())

