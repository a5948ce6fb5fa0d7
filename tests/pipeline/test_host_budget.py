"""The host-memory budget's parts on their own: the account (HostBudget), the slot ring
(SlotRing) and a streamed snapshot's copy-out counters (StreamSnapshot). Events and counters
only: nothing here depends on timing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mithril_async.errors import HostMemoryExceeded, SnapshotTorn
from mithril_async.memory.budget import HostBudget
from mithril_async.memory.ring import SlotLease, SlotRing
from mithril_async.save.stream_snapshot import StreamSnapshot


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_budget_waits_for_a_release_and_records_the_peak() -> None:
    async def main() -> None:
        b = HostBudget(100)
        b.set_fixed("ring", 40)
        await b.acquire(50, "a")
        waiter = asyncio.ensure_future(b.acquire(20, "b"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done() and b.held == 90  # 110 would pass the limit: it waits
        b.release(50)
        await asyncio.wait_for(waiter, 5)
        assert b.held == 60 and b.peak == 90
        b.reset_peak()
        assert b.peak == 60
        with pytest.raises(HostMemoryExceeded, match=r"x needs .* of which .* staging"):
            await b.acquire(61, "x")  # more than the limit less the fixed part: never fits
        with pytest.raises(HostMemoryExceeded, match="tensor t"):
            b.take(41, "tensor t")
        assert b.held == 60

    run(main())


def test_unlimited_budget_only_counts() -> None:
    async def main() -> None:
        b = HostBudget(None)
        await b.acquire(1 << 40, "huge")
        assert b.try_take(5) and b.held == (1 << 40) + 5 == b.peak

    run(main())


def test_a_release_from_another_thread_wakes_the_loop() -> None:
    async def main() -> None:
        b = HostBudget(10)
        await b.acquire(10, "a")
        waiter = asyncio.ensure_future(b.acquire(10, "b"))
        await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, b.release, 10)
        await asyncio.wait_for(waiter, 5)
        assert b.held == 10

    run(main())


def test_ring_serves_now_requests_before_later_ones_and_survives_cancels() -> None:
    async def main() -> None:
        ring = SlotRing(1, 64)
        first = await ring.acquire(later=False)
        later = asyncio.ensure_future(ring.acquire(later=True))
        cancelled = asyncio.ensure_future(ring.acquire(later=False))
        now = asyncio.ensure_future(ring.acquire(later=False))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        first.release()
        first.release()  # idempotent: the slot is given once
        lease = await asyncio.wait_for(now, 5)
        assert not later.done() and lease.index == 0 and ring.free == 0
        lease.release()
        lease2 = await asyncio.wait_for(later, 5)
        lease2.release()
        assert ring.free == 1

    run(main())


def test_stream_snapshot_resolves_now_then_all_and_checks_versions() -> None:
    ring = SlotRing(2, 1 << 10)
    a = torch.arange(300, dtype=torch.float32)  # 1200 bytes: two chunks
    b = torch.arange(100, dtype=torch.int64)
    calls: list[str] = []
    snap = StreamSnapshot(ring, on_now=lambda: calls.append("now"))
    ta = snap.add("model", "a", a, later=False)
    tb = snap.add("optimizer", "b", b, later=True)
    snap.start()
    assert not snap.now_done.done()

    def lease(later: bool = False) -> SlotLease:
        return asyncio.run(ring.acquire(later))

    l1 = lease()
    got = ta.fetch(l1, 0, 1024).copy()
    l1.release()
    assert not snap.now_done.done()
    l2 = lease()
    got2 = ta.fetch(l2, 1024, 176).copy()
    l2.release()
    assert snap.now_done.done() and calls == ["now"] and not snap.all_done.done()
    assert np.concatenate([got, got2]).tobytes() == a.numpy().tobytes()
    b.add_(1)  # changed in place before its copy-out: the last fetch says so
    l3 = lease(True)
    with pytest.raises(SnapshotTorn, match="optimizer/b"):
        tb.fetch(l3, 0, 800)
    l3.release()
    assert snap.all_done.done()  # a step is never left waiting
    with pytest.raises(ValueError, match="outside"):
        ta.fetch(lease(), 1100, 200)


def test_close_resolves_a_snapshot_cut_short() -> None:
    snap = StreamSnapshot(SlotRing(1, 16))
    snap.add("m", "x", torch.ones(8), later=True)
    snap.start()
    assert snap.now_done.done() and not snap.all_done.done()
    snap.close()
    assert snap.all_done.done()


class _FakeEvent:
    def __init__(self) -> None:
        self.recorded = 0
        self.synchronized = 0

    def record(self, stream: object = None) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        assert self.recorded > self.synchronized, "waited for before its copy was queued"
        self.synchronized += 1


class _FakeCopier:
    """Stands in for CudaCopier: same calls, CPU copies, a log of the order of things."""

    def __init__(self) -> None:
        self.events: list[_FakeEvent] = []
        self.log: list[tuple[int, int]] = []  # (event id, bytes) per queued copy

    def new_event(self) -> _FakeEvent:
        self.events.append(_FakeEvent())
        return self.events[-1]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event: _FakeEvent) -> None:
        dst.copy_(src)  # "non_blocking" on the side stream
        event.record()
        self.log.append((self.events.index(event), src.numel()))
        event.synchronize()  # the codec thread waits for this slot's copy only


def test_device_tensors_copy_behind_one_event_per_slot() -> None:
    """The CUDA path with stand-ins: each device chunk is queued on the copier, recorded on
    its slot's event, and that event is waited for before the bytes are handed on; a slot
    reuses its event."""
    ring = SlotRing(2, 256)
    copier = _FakeCopier()
    snap = StreamSnapshot(ring, copier=copier)
    src = torch.arange(160, dtype=torch.float32)  # 640 bytes: 3 chunks of <= 256
    t = snap.add("model", "w", src, later=False, device=True)
    snap.start()
    out = []
    leases = [asyncio.run(ring.acquire()) for _ in range(2)]
    for k, (off, n) in enumerate(((0, 256), (256, 256), (512, 128))):
        lease = leases[k % 2]
        out.append(t.fetch(lease, off, n).copy())
        if k == 1:
            leases[0].release()
            leases[0] = asyncio.run(ring.acquire())
    assert np.concatenate(out).tobytes() == src.numpy().tobytes()
    assert len(copier.events) == 2  # one per slot, made on first use, then reused
    assert [e for e, _ in copier.log] == [0, 1, 0]
    assert all(e.synchronized == e.recorded for e in copier.events)
    assert snap.now_done.done() and snap.all_done.done()
