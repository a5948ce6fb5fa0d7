"""The Stager on CPU, with a stand-in for the CUDA event that gates a device snapshot."""

from __future__ import annotations

import asyncio

import torch

from mithril_async.pipeline.stager import Snapshot, StagingArea


class FakeEvent:
    """Completes after ``polls`` queries, like a cudaEvent behind queued D2H copies."""

    def __init__(self, polls: int) -> None:
        self.left = polls
        self.synchronized = False

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.synchronized = True
        self.left = -1


def test_snapshot_copies_and_reuses_buffers() -> None:
    area = StagingArea(pin_memory=False)
    src = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
           "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.arange(8).reshape(2, 4).t()}
    snap = area.snapshot(src)
    assert not snap.reused and snap.devices == {"cpu"}
    assert snap.nbytes == 12 * 4 + 5 * 2 + 8 * 8
    for k, v in src.items():
        assert torch.equal(snap.tensors[k], v) and snap.tensors[k].data_ptr() != v.data_ptr()
        assert snap.tensors[k].is_contiguous()
    ptrs = {k: t.data_ptr() for k, t in snap.tensors.items()}
    src["a"].add_(1)  # training continues: the snapshot must not change
    assert snap.tensors["a"][0, 0] == 0
    again = area.snapshot(src)
    assert again.reused and {k: t.data_ptr() for k, t in again.tensors.items()} == ptrs
    assert again.tensors["a"][0, 0] == 1


def test_layout_change_reallocates_and_drops_stale() -> None:
    area = StagingArea(pin_memory=False)
    area.snapshot({"a": torch.zeros(4), "b": torch.zeros(2)})
    snap = area.snapshot({"a": torch.zeros(8)})
    assert not snap.reused and snap.tensors["a"].shape == (8,)
    assert area.nbytes == 8 * 4


def test_snapshot_waits_for_device_event() -> None:
    ev = FakeEvent(polls=5)
    snap = Snapshot({}, event=ev)
    assert not snap.ready()
    asyncio.run(snap.wait(poll_s=0))
    assert snap.ready() and ev.left < 0
    ev2 = FakeEvent(polls=100)
    Snapshot({}, event=ev2).wait_blocking()
    assert ev2.synchronized
    assert Snapshot({}).ready()  # CPU snapshots are complete immediately
