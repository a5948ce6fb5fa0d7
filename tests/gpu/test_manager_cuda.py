"""The manager on a real device, blocking and overlapped snapshots of a CUDA model + AdamW:
every version holds the state of its ``save()`` while the next steps run on the device, a
change outside ``optimizer.step()`` fails an overlapped save with ``SnapshotTorn``, restores
land in the live device tensors, and the staging buffers of device tensors are pinned.

Mirrors tests/manager/test_overlap.py, whose device paths run there with stand-in events.
Nothing here asserts a duration: where a race must be possible, a device-side sleep on the
stager's side stream holds the copies back (``slow_side_stream``), and where the order of
host-side checks matters, a gate holds the pipeline (``_gated_pipeline``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, Config, SaveFailed, SnapshotTorn, TensorDict
from mithril_async.save import overlap
from mithril_async.save.staging import HostCopies, StagingArea
from tests.manager.conftest import state_equal

from ._helpers import (
    CUDA_ONLY,
    DEV,
    live,
    make_cuda_state,
    slow_side_stream,
    train_step,
)

pytestmark = CUDA_ONLY

MODES = ["blocking", "overlapped"]
RAW = "[checkpointing.compression]\nenabled = false\n"


def _cfg(make_config: Callable[..., Config], snapshot: str, extra: str = "") -> Config:
    return make_config(f'[checkpointing.pipeline]\nsnapshot = "{snapshot}"\n' + extra)


def _gated_pipeline(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the pipeline before it polls the device events (so before it compares version
    counters) until the returned gate is set."""
    gate = threading.Event()
    real = overlap.await_event

    async def gated(event: Any, poll_s: float = 0.0002) -> None:
        while not gate.is_set():
            await asyncio.sleep(0.001)
        await real(event, poll_s)

    monkeypatch.setattr(overlap, "await_event", gated)
    return gate


def _spy_snapshots(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, torch.Tensor],
                                                                   HostCopies]]:
    seen: list[tuple[dict[str, torch.Tensor], HostCopies]] = []
    real = StagingArea.snapshot

    def spy(self: StagingArea, tensors: dict[str, torch.Tensor], *a: Any, **k: Any) -> HostCopies:
        snap = real(self, tensors, *a, **k)
        seen.append((dict(tensors), snap))
        return snap

    monkeypatch.setattr(StagingArea, "snapshot", spy)
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("snapshot", MODES)
def test_every_version_holds_the_state_of_its_save(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch,
        snapshot: str, fused: bool) -> None:
    """A step is queued on the device right after each ``save()`` returns, while the side
    stream still holds the copies back: its forward (which changes the ``calls`` buffer) and
    its ``optimizer.step()`` must run after the copies of what they change."""
    slow_side_stream(monkeypatch)
    model, opt, batcher = make_cuda_state(fused=fused)
    expected: dict[int, dict[str, Any]] = {}
    state = {"model": model, "optimizer": opt, "batcher": batcher}
    with CheckpointManager(_cfg(make_config, snapshot), state) as m:
        train_step(model, opt, batcher)
        for step in range(1, 6):
            expected[step] = live(model, opt)
            handle = m.save_nowait(step)
            train_step(model, opt, batcher)
            train_step(model, opt, batcher)
            assert handle.result_obj.stall_s >= 0
        m.wait()
        if snapshot == "overlapped":
            assert m.saves.guard is not None and m.saves.guard.pointers()  # device tensors deferred
        assert [r.status for r in m.history] == ["committed"] * 5
        for step in range(1, 6):
            assert m.restore_sync(step) == step
            assert state_equal(live(model, opt), expected[step]), step
            assert batcher.position == 1 + 2 * (step - 1)


def test_async_save_on_device(make_config: Callable[..., Config]) -> None:
    """``await save()`` polls the copy event from the event loop instead of blocking."""
    model, opt, batcher = make_cuda_state()
    train_step(model, opt, batcher)
    want = live(model, opt)

    async def go() -> None:
        async with CheckpointManager(_cfg(make_config, "blocking"),
                                     {"model": model, "optimizer": opt}) as m:
            handle = await m.save(1)
            train_step(model, opt, batcher)
            await m.wait_until_finished()
            assert handle.result().status == "committed"
            assert await m.restore(1) == 1
            assert state_equal(live(model, opt), want)

    asyncio.run(go())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_change_outside_step_fails_the_save_and_keeps_the_last(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch,
        fused: bool) -> None:
    model, opt, batcher = make_cuda_state(fused=fused)
    train_step(model, opt, batcher)
    with CheckpointManager(_cfg(make_config, "overlapped"),
                           {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        committed = live(model, opt)
        gate = _gated_pipeline(monkeypatch)
        handle = m.save_nowait(2)
        with torch.no_grad():
            model.head.weight.add_(1.0)  # not through optimizer.step(): nothing orders it
        gate.set()
        with pytest.raises(SaveFailed) as info:
            m.wait()
        assert isinstance(info.value.__cause__, SnapshotTorn)
        assert "head.weight" in str(info.value)
        assert handle.result_obj.status == "failed"
        assert m.latest_step() == 1 and m.all_steps() == [1]
        m.restore_sync("latest")
        assert state_equal(live(model, opt), committed)
        monkeypatch.undo()
        train_step(model, opt, batcher)
        m.save_nowait(3).result()  # the manager goes on
        assert m.all_steps() == [1, 3]


def test_change_queued_before_the_step_is_caught_at_the_hook(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """The change is queued before ``optimizer.step()``; the step hook compares the version
    counters before it orders the step after the copies, so the save fails."""
    model, opt, batcher = make_cuda_state()
    train_step(model, opt, batcher)
    with CheckpointManager(_cfg(make_config, "overlapped"),
                           {"model": model, "optimizer": opt}) as m:
        gate = _gated_pipeline(monkeypatch)
        m.save_nowait(1)
        with torch.no_grad():
            model.body[0][0].bias.mul_(2.0)
        train_step(model, opt, batcher)  # the hook sees the changed counter
        gate.set()
        with pytest.raises(SaveFailed) as info:
            m.wait()
        assert isinstance(info.value.__cause__, SnapshotTorn)
        assert "body.0.0.bias" in str(info.value)
        assert m.all_steps() == []


def test_hundred_overlapped_saves_none_torn(make_config: Callable[..., Config],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's target: no torn version in 100 saves, each followed at once by a step."""
    slow_side_stream(monkeypatch, 2_000_000)
    model, opt, batcher = make_cuda_state(width=512, layers=3)
    expected: dict[int, dict[str, Any]] = {}
    with CheckpointManager(_cfg(make_config, "overlapped", RAW),
                           {"model": model, "optimizer": opt}) as m:
        train_step(model, opt, batcher)
        for step in range(1, 101):
            expected[step] = live(model, opt)
            m.save_nowait(step)
            train_step(model, opt, batcher)
        m.wait()
        assert [r.status for r in m.history] == ["committed"] * 100
        torn = []
        for step in range(1, 101):
            m.restore_sync(step)
            if not state_equal(live(model, opt), expected[step]):
                torn.append(step)
        assert torn == []


@pytest.mark.parametrize("snapshot", MODES)
def test_restore_lands_in_the_device_tensors(make_config: Callable[..., Config],
                                             snapshot: str) -> None:
    model, opt, batcher = make_cuda_state()
    ema = TensorDict({"ema": torch.randn(1000, device=DEV),
                      "count": torch.zeros((), dtype=torch.int64, device=DEV)})
    train_step(model, opt, batcher)
    with CheckpointManager(_cfg(make_config, snapshot),
                           {"model": model, "optimizer": opt, "ema": ema}) as m:
        want = live(model, opt)
        want_ema = {k: v.clone() for k, v in ema.tensors.items()}
        m.save_nowait(1).result()
        for _ in range(3):
            train_step(model, opt, batcher)
        ema.tensors["ema"].mul_(3)
        ema.tensors["count"].add_(5)
        params = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
        ema_ptr = ema.tensors["ema"].data_ptr()
        assert m.restore_sync(1) == 1
        for n, p in model.named_parameters():  # the very same device tensors, new values
            assert p is params[n][0] and p.data_ptr() == params[n][1] and p.is_cuda, n
        for per_param in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                assert per_param[k].is_cuda, k
        assert ema.tensors["ema"].is_cuda and ema.tensors["ema"].data_ptr() == ema_ptr
        assert state_equal(live(model, opt), want)
        assert state_equal(ema.tensors, want_ema)
        train_step(model, opt, batcher)  # training goes on from the restored state
        m.save_nowait(2).result()


@pytest.mark.parametrize("snapshot", MODES)
def test_device_tensors_are_staged_in_pinned_memory(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch,
        snapshot: str) -> None:
    seen = _spy_snapshots(monkeypatch)
    model, opt, batcher = make_cuda_state()
    train_step(model, opt, batcher)
    with CheckpointManager(_cfg(make_config, snapshot),
                           {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        train_step(model, opt, batcher)
        m.save_nowait(2).result()
    assert seen
    device_bufs = 0
    for tensors, snap in seen:
        for name, src in tensors.items():
            if src.is_cuda:
                assert snap.tensors[name].is_pinned(), name
                device_bufs += 1
            else:
                assert not snap.tensors[name].is_cuda, name
    # per save: every parameter, the `calls` buffer, exp_avg and exp_avg_sq of each parameter
    assert device_bufs >= 2 * (1 + 3 * len(list(model.parameters())))
