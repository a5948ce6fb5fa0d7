"""Overlapped snapshots: optimizer-owned tensors are copied after ``save()`` returns, the next
``optimizer.step()`` waits for that copy, and any other in-place change meanwhile fails the save
(SnapshotTorn) without touching the last committed version."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, Config, SaveFailed, SnapshotTorn
from mithril_async.pipeline.loop import lower_priority
from mithril_async.save import overlap
from mithril_async.save.staging import StagingArea

from .conftest import Batcher, FakeEvent, TinyNet, make_state, state_equal, train_step

OVERLAPPED = '[checkpointing.pipeline]\nsnapshot = "overlapped"\n'


@pytest.fixture(params=["inline", "worker"])
def make_config(request: pytest.FixtureRequest, make_config: Callable[..., Config],
                make_worker_config: Callable[..., Config]) -> Callable[..., Config]:
    """Every test of this module runs with the save's background part inline and in a
    checkpoint worker process (a test passing its own store runs inline either way)."""
    return make_worker_config if request.param == "worker" else make_config


class CountingNet(TinyNet):
    """TinyNet plus a buffer that every forward changes in place (like batch-norm stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(4096))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x)


def _gated_copy(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[int]]:
    """Make every overlapped copy wait for the returned event; record the bytes it copies."""
    gate = threading.Event()
    copied: list[int] = []
    real = overlap.copy_jobs

    def gated(jobs: Any, threads: int) -> None:
        assert gate.wait(60)  # a safety net: the test opens the gate
        copied.append(sum(n for _, _, n in jobs))
        real(jobs, threads)

    monkeypatch.setattr(overlap, "copy_jobs", gated)
    return gate, copied


def _live(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(opt.state_dict())}


def test_every_version_holds_the_state_of_its_save(make_config: Callable[..., Config]) -> None:
    torch.manual_seed(0)
    model = CountingNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batcher = Batcher()
    expected: dict[int, dict[str, Any]] = {}
    with CheckpointManager(make_config(OVERLAPPED),
                           {"model": model, "optimizer": opt, "batcher": batcher}) as m:
        train_step(model, opt, batcher)
        for step in range(1, 7):
            expected[step] = _live(model, opt)
            handle = m.save_nowait(step)
            train_step(model, opt, batcher)  # forward changes `calls` before step() waits
            assert handle.result_obj.stall_s >= 0
        m.wait()
        guard = m.saves.guard
        assert guard is not None and guard.pointers()  # tensors really were deferred
        for step in range(1, 7):
            assert m.restore_sync(step) == step
            assert state_equal(_live(model, opt), expected[step]), step
        assert [r.status for r in m.history] == ["committed"] * 6


class _CheckedFuture(concurrent.futures.Future[None]):
    """Mirrors an overlapped copy's future; the first ``done()`` that answers False sets
    ``checked`` (the step hook found the copy unfinished and is about to wait for it)."""

    def __init__(self, inner: concurrent.futures.Future[None], checked: threading.Event) -> None:
        super().__init__()
        self.checked = checked
        inner.add_done_callback(self._mirror)

    def _mirror(self, inner: concurrent.futures.Future[None]) -> None:
        err = inner.exception()
        if err is None:
            self.set_result(None)
        else:
            self.set_exception(err)

    def done(self) -> bool:
        finished = super().done()
        if not finished:
            self.checked.set()
        return finished


def test_step_waits_for_the_copy_and_the_wait_is_reported(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic, whatever the machine's speed: the copy is held until the step hook has
    seen it unfinished, so step() can only go on by waiting for it."""
    checked = threading.Event()
    copied: list[int] = []
    order: list[str] = []
    real_copy, real_init = overlap.copy_jobs, overlap.OverlapCopy.__init__

    def gated(jobs: Any, threads: int) -> None:
        assert checked.wait(60), "no step hook asked for the copy"
        copied.append(sum(n for _, _, n in jobs))
        real_copy(jobs, threads)
        order.append("copy")

    def init(self: overlap.OverlapCopy, *a: Any, **kw: Any) -> None:
        real_init(self, *a, **kw)
        self.future = _CheckedFuture(self.future, checked)

    monkeypatch.setattr(overlap, "copy_jobs", gated)
    monkeypatch.setattr(overlap.OverlapCopy, "__init__", init)
    model, opt, batcher = make_state()
    train_step(model, opt, batcher)
    before = _live(model, opt)
    with CheckpointManager(make_config(OVERLAPPED), {"model": model, "optimizer": opt}) as m:
        opt.register_step_post_hook(lambda *_: order.append("step"))
        handle = m.save_nowait(1)  # returns although the copy has not started
        assert not copied and not checked.is_set()
        train_step(model, opt, batcher)  # step() blocks until the copy it released ends
        assert checked.is_set() and order == ["copy", "step"]
        res = handle.result()
        assert res.status == "committed" and res.step_wait_s > 0
        params = sum(p.numel() * 4 for p in model.parameters())
        assert copied and copied[0] >= 3 * params  # weights + exp_avg + exp_avg_sq
        after = _live(model, opt)
        assert not state_equal(after, before)
        m.restore_sync(1)
        assert state_equal(_live(model, opt), before)


def test_change_outside_step_fails_the_save_and_keeps_the_last(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, batcher = make_state()
    train_step(model, opt, batcher)
    with CheckpointManager(make_config(OVERLAPPED), {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        committed = _live(model, opt)
        gate, _ = _gated_copy(monkeypatch)
        handle = m.save_nowait(2)
        with torch.no_grad():
            model.emb.weight.add_(1.0)  # not through optimizer.step(): nothing waits for it
        gate.set()
        with pytest.raises(SaveFailed) as info:
            m.wait()
        assert isinstance(info.value.__cause__, SnapshotTorn)
        assert "emb.weight" in str(info.value)
        assert handle.result_obj.status == "failed"
        assert m.latest_step() == 1 and m.all_steps() == [1]
        m.restore_sync("latest")
        assert state_equal(_live(model, opt), committed)
        monkeypatch.undo()
        m.save_nowait(3).result()  # the manager goes on
        assert m.all_steps() == [1, 3]


def test_blocking_mode_hooks_nothing(make_config: Callable[..., Config],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    monkeypatch.setattr(overlap.OverlapCopy, "__init__",
                        lambda *a, **k: made.append(1))  # would break a save if used
    model, opt, _batcher = make_state()
    with CheckpointManager(make_config(), {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        assert m.saves.guard is None and not opt._optimizer_step_pre_hooks
    assert not made


def test_close_removes_the_hooks(make_config: Callable[..., Config]) -> None:
    model, opt, _batcher = make_state()
    m = CheckpointManager(make_config(OVERLAPPED), {"model": model, "optimizer": opt})
    m.save_nowait(1)
    assert len(opt._optimizer_step_pre_hooks) == 1
    m.close()
    assert not opt._optimizer_step_pre_hooks
    assert m.history[-1].status == "committed"


def test_without_an_optimizer_everything_is_copied_at_save(
        make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture) -> None:
    model = TinyNet()
    with CheckpointManager(make_config(OVERLAPPED), {"model": model}) as m:
        m.save_nowait(1)
        guard = m.saves.guard
        assert guard is not None and guard.pending is None and not guard.pointers()
        m.wait()
    assert "no optimizer in the state" in caplog.text


def test_stager_defers_exactly_the_named_sources() -> None:
    area = StagingArea(pin_memory=False, copy_threads=1)
    a, b = torch.randn(1000), torch.randn(10)
    b.add_(1)
    snap = area.snapshot({"a": a, "b": b}, frozenset({b.data_ptr()}))
    assert torch.equal(snap.tensors["a"], a) and not torch.equal(snap.tensors["b"], b)
    assert snap.deferred == [(b.data_ptr(), snap.tensors["b"].data_ptr(), 40)]
    assert [(n, t is b, v) for n, t, v in snap.watch] == [("b", True, b._version)]
    copy = overlap.OverlapCopy(snap.deferred, snap.watch, 1)
    copy.future.result(60)  # a safety net; the copy is tiny
    assert torch.equal(snap.tensors["b"], b)


def test_torn_copy_names_tensors() -> None:
    area = StagingArea(pin_memory=False, copy_threads=1)
    tensors = {f"t{i}": torch.zeros(8) for i in range(7)}
    snap = area.snapshot(tensors, frozenset(t.data_ptr() for t in tensors.values()))
    for t in tensors.values():
        t.add_(1)
    copy = overlap.OverlapCopy(snap.deferred, snap.watch, 1)
    with pytest.raises(SnapshotTorn, match=r"7 tensor\(s\) changed.*t0, t1, t2, t3, t4 and 2 more"):
        copy.future.result(60)  # a safety net; the copy is tiny


def _nice_of(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


@pytest.mark.parametrize("nice", [0, 7])
def test_background_threads_run_at_lower_priority(make_config: Callable[..., Config],
                                                  nice: int) -> None:
    """The loop, codec and writer threads give way to training; the training thread and the
    overlapped copy (which a step may wait on) keep their priority."""
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    me = threading.current_thread()
    model, opt, batcher = make_state()
    cfg = make_config(OVERLAPPED + f"background_nice = {nice}\n"
                      "[checkpointing.compression]\nthreads = 2\n")
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1)
        train_step(model, opt, batcher)
        m.wait()
        want = min(19, base + nice)
        assert _nice_of(m.loop.thread) == want
        if m.process == "worker":  # the codec and writer threads are the worker's
            assert m.worker_pid is not None
            assert os.getpriority(os.PRIO_PROCESS, m.worker_pid) == want
        else:
            workers = [t for t in threading.enumerate()
                       if t.name.startswith(("mithril-codec", "asyncio_", "uvloop_"))]
            assert {t.name.split("_")[0] for t in workers} >= {"mithril-codec", m.loop.kind}
            assert all(_nice_of(t) == want for t in workers), [(t.name, _nice_of(t))
                                                                for t in workers]
        copier = [t for t in threading.enumerate() if t.name.startswith("mithril-overlap")]
        assert copier and all(_nice_of(t) == base for t in copier)
        assert _nice_of(me) == base
    assert lower_priority(0) is False


def _record_ordering(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace 'current stream waits for event' by a record of the events it was given."""
    ordered: list[Any] = []
    monkeypatch.setattr(overlap, "order_after", ordered.append)
    return ordered


def test_device_copies_are_ordered_not_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other tensors' copies order the stream at once, the optimizer-owned ones only
    before step(); the pipeline polls both; nothing blocks the CPU until a restore asks."""
    ordered = _record_ordering(monkeypatch)
    now, later = FakeEvent(), FakeEvent()
    src = torch.zeros(4)
    copy = overlap.OverlapCopy([], [], 1, events_now=[now], events_later=[later],
                               device_watch=[("p", src, src._version)])
    assert ordered == [now] and copy.future.done()
    assert copy.before_step() == 0.0
    assert ordered == [now, later] and not now.synchronized and not later.synchronized
    src.add_(1)  # the step itself, after the hook: not a tear
    asyncio.run(copy.finished(poll_s=0))
    assert now.left < 0 and later.left < 0
    copy.wait_blocking()
    assert now.synchronized and later.synchronized


def test_device_source_changed_before_the_step_is_torn(monkeypatch: pytest.MonkeyPatch) -> None:
    _record_ordering(monkeypatch)
    src, other = torch.zeros(4), torch.zeros(2)
    copy = overlap.OverlapCopy([], [], 1, events_later=[FakeEvent()],
                               device_watch=[("p", src, src._version),
                                             ("q", other, other._version)])
    src.mul_(2)  # queued before step(): may race the side stream's copy
    copy.before_step()
    with pytest.raises(SnapshotTorn, match=r"1 tensor\(s\) changed.*: p;"):
        asyncio.run(copy.finished(poll_s=0))


def test_step_hook_orders_device_copies_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ordered = _record_ordering(monkeypatch)
    model, opt, batcher = make_state()
    guard = overlap.StepGuard([opt])
    later = FakeEvent()
    guard.pending = overlap.OverlapCopy([], [], 1, events_later=[later])
    train_step(model, opt, batcher)
    train_step(model, opt, batcher)
    assert ordered == [later] and guard.pending is None
    guard.remove()
    assert not opt._optimizer_step_pre_hooks
