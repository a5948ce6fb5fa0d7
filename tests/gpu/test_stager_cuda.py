"""The Stager on a real device: pinned staging buffers, device-to-host copies on a side stream
ordered after the producer's work, one event per batch of copies (never a device-wide
synchronize), and the deferred copies of an overlapped snapshot behind an event of their own.
The CPU stand-ins of these paths are in tests/manager/test_stager.py and test_overlap.py."""

from __future__ import annotations

import pytest
import torch

from mithril_async.save.staging import StagingArea

from ._helpers import CUDA_ONLY, DEV

pytestmark = CUDA_ONLY


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(0)
    return {
        "f32": torch.randn(1 << 16, device=DEV, generator=g),
        "bf16": torch.randn(3, 1000, device=DEV, generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 1 << 40, (777,), device=DEV, generator=g),
        "strided": torch.randn(64, 32, device=DEV, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(2.5, device=DEV),
        "empty": torch.zeros(0, 3, device=DEV),
        "host": torch.arange(10, dtype=torch.float32),  # a CPU tensor beside them
    }


def test_device_tensors_go_to_pinned_reused_buffers() -> None:
    area = StagingArea()  # pins by default where CUDA is available
    src = _state()
    snap = area.snapshot(src)
    assert snap.event is not None and snap.devices == {"cuda", "cpu"}
    snap.wait_blocking()
    assert snap.ready()
    for k, v in src.items():
        buf = snap.tensors[k]
        assert buf.device.type == "cpu" and buf.is_contiguous(), k
        if v.numel():  # an empty buffer has no memory to pin
            assert buf.is_pinned() == (v.device.type == "cuda"), k
        assert torch.equal(buf, v.cpu()), k
    ptrs = {k: t.data_ptr() for k, t in snap.tensors.items()}
    src["f32"].add_(1)  # training goes on: the staged copy does not change
    assert not torch.equal(snap.tensors["f32"], src["f32"].cpu())
    again = area.snapshot(src)
    again.wait_blocking()
    assert again.reused and {k: t.data_ptr() for k, t in again.tensors.items()} == ptrs
    assert all(again.tensors[k].is_pinned() for k, v in src.items() if v.is_cuda and v.numel())
    assert torch.equal(again.tensors["f32"], src["f32"].cpu())


def test_copies_are_ordered_after_the_producers_work() -> None:
    """The side stream waits for the current stream: a value written by a kernel still queued
    (behind a device-side sleep) when ``snapshot()`` is called is the value staged."""
    t = torch.zeros(1 << 20, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the fill below is still queued when snapshot() runs
    t.fill_(7.0)
    snap = StagingArea().snapshot({"t": t})
    snap.wait_blocking()
    assert bool((snap.tensors["t"] == 7.0).all())


def test_snapshot_waits_for_its_event_not_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for a snapshot synchronizes its event only: no device-wide or stream-wide
    synchronize (other streams keep running), checked by spying on them, not by a clock."""
    calls: list[str] = []
    real_sync, real_stream_sync = torch.cuda.synchronize, torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: (calls.append("device"), real_sync(*a, **k))[1])
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: (calls.append("stream"), real_stream_sync(self))[1])
    src = {"a": torch.randn(1 << 18, device=DEV)}
    snap = StagingArea().snapshot(src)
    snap.wait_blocking()
    assert snap.event.query() and torch.equal(snap.tensors["a"], src["a"].cpu())
    assert calls == []


def test_deferred_device_copies_have_their_own_event() -> None:
    """Overlapped snapshots: the named device tensors are copied after the others, behind
    ``later_event``, and their version counters are recorded."""
    area = StagingArea()
    p, b = torch.randn(4096, device=DEV), torch.randn(16, device=DEV)
    snap = area.snapshot({"p": p, "b": b}, frozenset({p.data_ptr()}))
    assert snap.event is not None and snap.later_event is not None
    assert [(n, t is p, v) for n, t, v in snap.later_watch] == [("p", True, p._version)]
    assert not snap.deferred and not snap.watch  # no host-side jobs for device tensors
    snap.later_event.synchronize()
    snap.event.synchronize()
    assert torch.equal(snap.tensors["p"], p.cpu()) and torch.equal(snap.tensors["b"], b.cpu())
    assert snap.tensors["p"].is_pinned()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_big_device_snapshot_is_byte_identical(dtype: torch.dtype) -> None:
    src = {f"w{i}": torch.randn(1 << 20, device=DEV).to(dtype) for i in range(8)}
    snap = StagingArea().snapshot(src)
    snap.wait_blocking()
    for k, v in src.items():
        assert snap.tensors[k].dtype == dtype
        assert torch.equal(snap.tensors[k].view(torch.uint8), v.cpu().view(torch.uint8)), k
