"""The Stager on CPU, with a stand-in for the CUDA event that gates a device snapshot."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
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


def test_big_tensors_take_the_streaming_copy_and_come_out_identical(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of >= 1 MiB go through the native non-temporal copy: byte-identical snapshots
    for every dtype family, parameters that require grad included; views that are not plain
    bytes (non-contiguous, conjugated) keep ``copy_``."""
    from mithril_async.codec import kernels as K
    from mithril_async.pipeline import stager

    calls: list[int] = []
    real = K.copy_stream

    def spy(src: np.ndarray, out: np.ndarray) -> np.ndarray:
        calls.append(src.size)
        return real(src, out)

    monkeypatch.setattr(K, "copy_stream", spy)
    g = torch.Generator().manual_seed(0)
    n = (stager.STREAM_COPY_MIN_BYTES // 2) + 7  # 2-byte dtypes: just over the threshold
    src = {
        "bf16": torch.randn(n, generator=g).to(torch.bfloat16),
        "f32": torch.nn.Parameter(torch.randn(n, generator=g)),  # requires grad
        "i64": torch.randint(0, 1 << 40, (n,), generator=g),
        "bool": torch.rand(2 * n, generator=g) > 0.5,
        "strided": torch.randn(n, 4, generator=g).t(),  # not contiguous
        "conj": torch.randn(n, dtype=torch.complex64, generator=g).conj(),
        "small": torch.randn(100, generator=g),
    }
    area = StagingArea(pin_memory=False)
    for _ in range(2):  # fresh buffers, then reused ones
        calls.clear()
        snap = area.snapshot(src)
        for k, v in src.items():
            assert torch.equal(snap.tensors[k], v.detach()), k
        want = [2 * n, 2 * n, 4 * n, 8 * n] if K.native_available() else []
        assert sorted(calls) == want, calls
    if K.native_available():
        assert stager._stream_copyable(snap.tensors["f32"], src["f32"])
