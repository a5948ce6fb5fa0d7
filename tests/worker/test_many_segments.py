"""A state staged in far more shared-memory segments than one channel message carries
descriptors: a real worker maps them all (sent in batches), saves, and a fresh process
restores every save bit for bit; a replacement worker is sent them all again."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mithril_async.worker.placement as placement
from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from mithril_async.worker.arena import SharedArena
from mithril_async.worker.channel import MAX_FDS
from tests.worker._procs import gone

#: tensors each one float over 16 segments of 4 KiB: each gets a segment of its own, however
#: the segments grow
_SEGMENT = 4096
_TENSORS = 150
_NUMEL = 16 * _SEGMENT // 4 + 1


class _Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(_NUMEL)) for _ in range(_TENSORS))
        self.small = torch.nn.Parameter(torch.zeros(7))


def _values(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return [torch.randn(p.shape, generator=g) for p in _Wide().parameters()]


def _set(model: _Wide, step: int) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), _values(step), strict=True):
            p.copy_(v)


def _exact(model: _Wide, step: int) -> bool:
    return all(torch.equal(p, v) for p, v in zip(model.parameters(), _values(step),
                                                   strict=True))


def _cfg(runs: Path) -> Any:
    return config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "wide", "pipeline": {"process": "worker"},
        "compression": {"delta": True}}})


def _segments_mapped(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:mithril" in line for line in f)


def _dead(pid: int, deadline_s: float = 120.0) -> bool:
    """Whether child ``pid`` has exited (every thread of it), left for its parent to reap."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        time.sleep(0.01)
    return False




def test_a_state_in_hundreds_of_segments_saves_through_a_worker_and_restores_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # small segments (the arena's constructor argument) so a small state needs hundreds
    monkeypatch.setattr(placement, "SharedArena",
                        functools.partial(SharedArena, segment_bytes=_SEGMENT))
    runs = tmp_path / "runs"
    model = _Wide()
    with CheckpointManager(_cfg(runs), {"model": model}) as mgr:
        assert mgr.process == "worker"
        for step in (1, 2, 3):  # two staging sets (delta): 2 x 150 segments and more
            _set(model, step)
            res = mgr.save_nowait(step).result()
            assert res.status == "committed", res.error
        first = mgr.worker_pid
        assert first is not None
        assert _segments_mapped(first) >= 2 * _TENSORS > 4 * MAX_FDS
        os.kill(first, signal.SIGKILL)  # between saves: the next one starts a new worker
        assert _dead(first)
        _set(model, 4)
        assert mgr.save_nowait(4).result().status == "committed"
        second = mgr.worker_pid
        assert second is not None and second != first
        assert _segments_mapped(second) >= 2 * _TENSORS  # every segment sent to it again
    assert gone(second)  # the worker exits once its trainer closed the channel
    for step in (1, 2, 3, 4):
        fresh = _Wide()
        with CheckpointManager(_cfg(runs), {"model": fresh}) as mgr:
            assert mgr.restore_sync(step) == step
        assert _exact(fresh, step)
