"""The checkpoint worker's life: started with its manager, it outlives job-wide signals long
enough to finish what it was handed, and ends once its trainer is gone, however that goes
(killed, signalled, a forked child holding the trainer's socket, a manager dropped without
``close()``). Real processes and real signals; which point of a save a signal lands at is
fixed by stopping the worker (SIGSTOP) or holding the copy's thread, never by timing.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager
from tests.worker._procs import alive, gone
from tests.worker._state import holds_step, make_model, set_step
from tests.worker.test_worker import _cfg

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TRAINER = HERE / "_lifecycle_trainer.py"
#: a hang guard only: how long a condition waited for may take on a loaded machine
DEADLINE_S = 120.0




def _read(out: Path, name: str) -> str:
    """What the trainer wrote to ``out/name``, waited for (a hang guard)."""
    end = time.monotonic() + DEADLINE_S
    while not (out / name).exists():
        assert time.monotonic() < end, f"the trainer never wrote {name}"
        time.sleep(0.01)
    return (out / name).read_text()


@contextlib.contextmanager
def _reaper(out: Path, *names: str) -> Iterator[None]:
    """Kill whatever the trainer named in ``out`` that is still alive when the test ends
    (on a failure: a worker that hung, a grandchild)."""
    try:
        yield
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.kill(int((out / name).read_text()), signal.SIGKILL)


def _trainer(scenario: str, tmp_path: Path, **kw: Any) -> subprocess.Popen[str]:
    out = tmp_path / "out"
    out.mkdir()
    return subprocess.Popen([sys.executable, str(TRAINER), scenario, str(tmp_path / "runs"),
                             str(out)], cwd=ROOT, text=True, start_new_session=True, **kw)


def _version(tmp_path: Path, step: int) -> Path:
    return tmp_path / "runs" / "w" / "versions" / f"v{step:06d}"


def _restores(tmp_path: Path, step: int) -> bool:
    fresh = make_model()
    with CheckpointManager(_cfg(tmp_path / "runs"), {"model": fresh}) as mgr:
        return mgr.restore_sync("latest") == step and holds_step(fresh, step)


def test_the_first_save_of_a_ready_worker_is_handed_over_before_save_nowait_returns(
        tmp_path: Path) -> None:
    """The worker starts with the manager; once it is ready the first ``save_nowait``
    returns only when the save is the worker's, so a SIGKILL right after loses nothing."""
    proc = _trainer("first-save-kill", tmp_path, stderr=subprocess.PIPE)
    out = tmp_path / "out"
    with _reaper(out, "worker"):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, err
        assert gone(int(_read(out, "worker")))
        assert (_version(tmp_path, 1) / "manifest.json").exists()
        assert _restores(tmp_path, 1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_whole_job_does_not_lose_a_save_handed_over(
        tmp_path: Path, signum: signal.Signals) -> None:
    """The save is handed over while the worker is stopped (so it is surely not done), the
    whole process group gets ``signum`` (scancel, Kubernetes, Ctrl-C, a closed terminal),
    then the worker goes on: it commits the save, then exits after its dead trainer."""
    proc = _trainer("handed-then-wait", tmp_path, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = tmp_path / "out"
    assert proc.stdin is not None and proc.stdout is not None
    with _reaper(out, "worker"):
        assert proc.stdout.readline().strip() == "ready"
        worker = int(_read(out, "worker"))
        os.kill(worker, signal.SIGSTOP)
        try:
            proc.stdin.write("save\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "handed"
            os.killpg(proc.pid, signum)
            proc.wait(timeout=DEADLINE_S)
        finally:
            os.kill(worker, signal.SIGCONT)
        proc.communicate()
        assert proc.returncode != 0  # the signal ended the trainer
        assert gone(worker), "the worker outlived its trainer past the save"
        assert (_version(tmp_path, 1) / "manifest.json").exists()
        assert _restores(tmp_path, 1)


def test_a_signal_save_is_committed_while_the_worker_got_the_signal_too(
        tmp_path: Path) -> None:
    """``save_on_signals = ["SIGTERM"]``: SIGTERM reaches the trainer, then the worker
    while it holds the save that signal asked for (a job's processes are signalled at
    slightly different moments; the worker is stopped meanwhile so the save is surely not
    done). The worker commits it; the log's "durable" is true; the trainer ends by SIGTERM
    and the worker after it."""
    proc = _trainer("signal-save", tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = tmp_path / "out"
    assert proc.stdout is not None
    with _reaper(out, "worker"):
        assert proc.stdout.readline().strip() == "ready"
        worker = int(_read(out, "worker"))
        os.kill(worker, signal.SIGSTOP)
        try:
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.stdout.readline().startswith("handed ")
            os.kill(worker, signal.SIGTERM)
        finally:
            os.kill(worker, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGTERM, err
        durable = re.findall(r"step (\d+) is durable \((v\d+)\)", err)
        assert len(durable) == 1 and "failed" not in err, err
        step, vid = int(durable[0][0]), durable[0][1]
        assert (tmp_path / "runs" / "w" / "versions" / vid / "manifest.json").exists()
        assert gone(int(_read(out, "worker")))
        assert _restores(tmp_path, step)


def test_an_overlapped_save_whose_trainer_died_before_its_copy_is_abandoned(
        tmp_path: Path) -> None:
    """The trainer is SIGKILLed after ``save()`` returned but before its overlapped copy
    finished: the worker abandons that save (no manifest, its claim removed) and exits, and
    a caller capturing the trainer's output is not held up by the worker."""
    out = tmp_path / "out"
    with _reaper(out, "worker"):
        out.mkdir()
        proc = subprocess.run([sys.executable, str(TRAINER), "overlap-kill",
                               str(tmp_path / "runs"), str(out)], cwd=ROOT, text=True,
                              capture_output=True, timeout=300, start_new_session=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert gone(int(_read(out, "worker")))
        assert not _version(tmp_path, 2).exists()  # no manifest, no claim, no blob
        assert _restores(tmp_path, 1)


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_a_child_outliving_its_trainer_does_not_keep_the_worker_alive(
        tmp_path: Path, how: str) -> None:
    """The trainer leaves a child that lives on (``os.fork``, or a process given the
    channel's socket) and is SIGKILLed: the worker sees its trainer gone and exits while the
    child still lives. A forked child closed its copy of the channel at once."""
    proc = _trainer(f"{how}-kill", tmp_path, stderr=subprocess.PIPE)
    out = tmp_path / "out"
    with _reaper(out, "worker", "grandchild"):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, err
        grandchild = int(_read(out, "grandchild"))
        assert gone(int(_read(out, "worker"))), "the worker outlived its trainer"
        assert alive(grandchild)
        if how == "fork":
            assert _read(out, "channel_in_grandchild") == "closed"
        os.kill(grandchild, signal.SIGKILL)
        assert gone(grandchild)


def _shared_memory() -> set[str]:
    """This process's staging segments still open or mapped (memfd, no file name)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "memfd:mithril" in target:
                fds.add(f"fd {fd}")
    with open("/proc/self/maps") as f:
        maps = {line.split()[0] for line in f if "memfd:mithril" in line}
    return fds | maps


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_manager_dropped_without_close_lets_its_worker_go(
        tmp_path: Path, in_flight: bool) -> None:
    """A manager garbage-collected without ``close()``: its worker finishes what it was
    handed (a save in flight commits), then exits, and its shared memory is released."""
    before = _shared_memory()
    threads = set(threading.enumerate())
    model = make_model()
    mgr = CheckpointManager(_cfg(tmp_path / "runs"), {"model": model})
    assert mgr.worker_ready(DEADLINE_S)
    worker = mgr.worker_pid
    assert worker is not None
    try:
        if in_flight:
            os.kill(worker, signal.SIGSTOP)  # handed over, surely not done when dropped
        set_step(model, 1)
        first = mgr.save_nowait(1)
        if not in_flight:
            assert first.result().status == "committed"
        del mgr, first
        gc.collect()
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may be gone already
            os.kill(worker, signal.SIGCONT)
    try:
        assert gone(worker, DEADLINE_S), "a dropped manager's worker lives on"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    assert (_version(tmp_path, 1) / "manifest.json").exists()
    end = time.monotonic() + DEADLINE_S
    while _shared_memory() - before or _new_threads(threads):
        assert time.monotonic() < end, (_shared_memory() - before, _new_threads(threads))
        time.sleep(0.01)
        gc.collect()  # the failed save's traceback holds its staging views in a cycle
    assert _restores(tmp_path, 1)


def _new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


def test_a_manager_that_only_restores_ends_its_worker_at_close(tmp_path: Path) -> None:
    """Every worker-mode manager starts a worker; one closed before it is ready (a restore,
    a query) ends it at once and leaves no process."""
    model = make_model()
    with CheckpointManager(_cfg(tmp_path / "runs"), {"model": model}) as mgr:
        set_step(model, 1)
        assert mgr.save_nowait(1).result().status == "committed"
    pids = []
    for _ in range(3):
        fresh = make_model()
        with CheckpointManager(_cfg(tmp_path / "runs"), {"model": fresh}) as mgr:
            pids.append(mgr.worker_pid)
            assert mgr.restore_sync("latest") == 1 and holds_step(fresh, 1)
    assert all(p is not None for p in pids)
    assert all(not alive(p) for p in pids if p is not None)  # reaped by close()
