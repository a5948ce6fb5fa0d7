"""Cancelling a save the trainer already handed to its checkpoint worker, and the trainer's
view of committed steps following the worker's (retention).

The worker is held with SIGSTOP (waited for until every thread of it is stopped) before the
save is handed over, so it has demonstrably read nothing of the snapshot when the save is
cancelled and the next save is taken; SIGCONT lets it go on. Nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from tests.worker._procs import gone
from tests.worker._state import holds_step, make_model, set_step


def _cfg(runs: Path, process: str = "worker", **checkpointing: Any) -> Any:
    pipeline = {"process": process, **checkpointing.pop("pipeline", {})}
    return config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "w", "pipeline": pipeline,
        "compression": {"delta": True}, **checkpointing}})






def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (SIGSTOP took effect)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # a thread that just ended
            continue
        if state not in ("T", "t"):
            return False
    return True


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    for _ in range(600_000):  # a hang guard only: stopping takes microseconds
        if _stopped(pid):
            return
        os.sched_yield()
    raise AssertionError(f"worker {pid} did not stop")




def _versions_exact(runs: Path, cancelled: int, later: int) -> list[int]:
    """Every committed version restores bit for bit to its own step's values; the
    cancelled save is absent or exact, the later one committed."""
    fresh = make_model()
    with CheckpointManager(_cfg(runs), {"model": fresh}) as mgr:
        steps = mgr.all_steps()
        for step in steps:
            assert mgr.restore_sync(step) == step
            assert holds_step(fresh, step), f"step {step} restored other values (a torn save)"
    assert later in steps and set(steps) <= {1, cancelled, later}, steps
    folders = sorted(p.name for p in (runs / "w" / "versions").iterdir())
    kept = sorted(p.parent.name for p in (runs / "w" / "versions").glob("*/manifest.json"))
    assert folders == kept, f"an aborted save left {sorted(set(folders) - set(kept))}"
    return steps


@pytest.mark.parametrize("how", ["future.cancel", "wait_for"])
def test_a_cancelled_handed_over_save_never_commits_torn(tmp_path: Path, how: str) -> None:
    """Step 2 is handed to a stopped worker and cancelled (its future cancelled, or a
    timeout around the next ``save()`` waiting for it); step 3, other values, is saved at
    once. Step 3's snapshot waits until the worker answered for step 2, so no committed
    version mixes the two."""
    runs = tmp_path / "runs"
    model = make_model()
    mgr = CheckpointManager(_cfg(runs), {"model": model})

    async def scenario() -> None:
        set_step(model, 1)
        assert (await mgr.save(1)).result().status == "committed"
        pid = mgr.worker_pid
        assert pid is not None
        _stop(pid)
        try:
            set_step(model, 2)
            h2 = await mgr.save(2)  # handed over: written to the stopped worker's socket
            if how == "future.cancel":
                assert h2.future is not None and h2.future.cancel()
            else:  # save(3) waits for step 2 (on_busy = "wait"); its timeout cancels it
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(mgr.save(3), 1.0)
                assert h2.future is not None and h2.future.cancelled()
            set_step(model, 3)
            save3 = asyncio.ensure_future(mgr.save(3))
            await asyncio.sleep(0)  # its first step: a snapshot, or the wait for the worker
        finally:
            os.kill(pid, signal.SIGCONT)
        h3 = await save3
        assert (await asyncio.wrap_future(h3.future)).status == "committed"
        await mgr.wait_until_finished()

    try:
        asyncio.run(scenario())
    finally:
        pid = mgr.worker_pid
        mgr.close()
    assert pid is not None and gone(pid)
    _versions_exact(runs, 2, 3)


def test_a_save_cancelled_in_the_worker_keeps_the_pipeline_busy_until_it_answers(
        tmp_path: Path) -> None:
    """``on_busy = "skip"``: while the worker has not answered for a cancelled save, the
    next save is skipped (its snapshot would be taken into the staging buffers the worker
    may still read); once it answered, ``wait()`` returns and saves go on."""
    runs = tmp_path / "runs"
    model = make_model()
    with CheckpointManager(_cfg(runs, pipeline={"on_busy": "skip"}), {"model": model}) as mgr:
        set_step(model, 1)
        assert mgr.save_nowait(1).result().status == "committed"
        pid = mgr.worker_pid
        assert pid is not None
        _stop(pid)
        try:
            set_step(model, 2)
            h2 = mgr.save_nowait(2)
            assert h2.future is not None and h2.future.cancel()
            set_step(model, 3)
            assert mgr.save_nowait(3).result().status == "skipped"
        finally:
            os.kill(pid, signal.SIGCONT)
        mgr.wait()  # the worker answered for step 2
        assert mgr.worker_pid == pid
        set_step(model, 3)
        assert mgr.save_nowait(3).result().status == "committed"
    assert gone(pid)
    _versions_exact(runs, 2, 3)


@pytest.mark.parametrize("process", ["worker", "inline"])
def test_a_step_retention_deleted_can_be_saved_again_after_a_rollback(
        tmp_path: Path, process: str) -> None:
    """Retention deletes step 2 (keep the best and the last two); the run rolls back to the
    best (step 1) and trains on: saving step 2 again commits (a new best, so retention keeps
    it), in either mode (the trainer's committed steps follow the worker's, retention
    included)."""
    runs = tmp_path / "runs"
    model = make_model()
    cfg = _cfg(runs, process, keep_last=2, keep_best=1, best_metric_name="loss")
    with CheckpointManager(cfg, {"model": model}) as mgr:
        assert mgr.process == process
        for step, loss in ((1, 0.1), (2, 1.0), (3, 1.0), (4, 1.0)):
            set_step(model, step)
            assert mgr.save_nowait(step, {"loss": loss}).result().status == "committed"
        assert mgr.all_steps() == [1, 3, 4]
        assert mgr.restore_sync("best") == 1 and holds_step(model, 1)
        set_step(model, 2)
        assert mgr.save_nowait(2, {"loss": 0.05}).result().status == "committed"
        assert mgr.restore_sync(2) == 2 and holds_step(model, 2)
