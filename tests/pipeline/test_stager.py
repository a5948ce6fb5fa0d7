"""The Stager on CPU, with a stand-in for the CUDA event that gates a device snapshot."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mithril_async.save.staging import HostCopies, StagingArea
from tests.manager.conftest import FakeEvent


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
    snap = HostCopies({}, event=ev)
    assert not snap.ready()
    asyncio.run(snap.wait(poll_s=0))
    assert snap.ready() and ev.left < 0
    ev2 = FakeEvent(polls=100)
    HostCopies({}, event=ev2).wait_blocking()
    assert ev2.synchronized
    assert HostCopies({}).ready()  # CPU snapshots are complete immediately


def test_plain_tensors_are_copied_in_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plain contiguous CPU tensor, small or big, goes into one ``copy_batch`` call (big
    ones streamed): byte-identical snapshots for every dtype family, parameters that require
    grad included; views that are not plain bytes (non-contiguous, conjugated) keep ``copy_``;
    empty tensors cost no job."""
    from mithril_async.codec import kernels as K
    from mithril_async.save import staging

    calls: list[list[int]] = []
    real = K.copy_batch

    def spy(jobs: list[tuple[int, int, int]], stream_min: int = 1 << 20) -> None:
        assert stream_min == staging.STREAM_COPY_MIN_BYTES
        calls.append(sorted(n for _, _, n in jobs))
        real(jobs, stream_min)

    monkeypatch.setattr(K, "copy_batch", spy)
    g = torch.Generator().manual_seed(0)
    n = (staging.STREAM_COPY_MIN_BYTES // 2) + 7  # 2-byte dtypes: just over the threshold
    src = {
        "bf16": torch.randn(n, generator=g).to(torch.bfloat16),
        "f32": torch.nn.Parameter(torch.randn(n, generator=g)),  # requires grad
        "i64": torch.randint(0, 1 << 40, (n,), generator=g),
        "bool": torch.rand(2 * n, generator=g) > 0.5,
        "strided": torch.randn(n, 4, generator=g).t(),  # not contiguous
        "conj": torch.randn(n, dtype=torch.complex64, generator=g).conj(),
        "small": torch.randn(100, generator=g),
        "odd": torch.arange(3, dtype=torch.uint8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "offset": torch.arange(64, dtype=torch.int16)[5:37],  # a contiguous view, offset
    }
    area = StagingArea(pin_memory=False)
    for _ in range(2):  # fresh buffers, then reused ones
        calls.clear()
        snap = area.snapshot(src)
        for k, v in src.items():
            assert torch.equal(snap.tensors[k], v.detach()), k
        want = [[3, 8, 64, 400, 2 * n, 2 * n, 4 * n, 8 * n]] if K.native_available() else [[]]
        assert calls == want, calls
    src["f32"].data.add_(1)  # the snapshot is a copy, not a view
    assert not torch.equal(snap.tensors["f32"], src["f32"].detach())


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 1 << 20), max_size=12))
def test_split_jobs_halves_bytes_and_covers_every_byte_once(sizes: list[int]) -> None:
    from mithril_async.save.staging import split_jobs

    jobs, at = [], 0
    for n in sizes:
        jobs.append((at, (1 << 40) + at, n))
        at += n
    first, second = split_jobs(jobs)
    covered = sorted((s, n) for s, _, n in first + second if n)
    assert all(d - s == 1 << 40 for s, d, _ in first + second)  # pieces keep src/dst paired
    pos = 0
    for s, n in covered:  # contiguous, no gap, no overlap
        assert s == pos
        pos += n
    assert pos == at
    assert abs(sum(n for *_, n in first) - sum(n for *_, n in second)) <= 1


def test_big_snapshot_is_copied_by_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """>= PARALLEL_COPY_MIN_BYTES with two copy threads: two native calls on two threads whose
    jobs together cover every byte; the snapshot is byte-identical (a tensor cut in two)."""
    import threading

    from mithril_async.codec import kernels as K
    from mithril_async.save import staging

    seen: list[tuple[str, int]] = []
    real = K.copy_batch

    def spy(jobs: list[tuple[int, int, int]], stream_min: int = 1 << 20) -> None:
        seen.append((threading.current_thread().name, sum(n for *_, n in jobs)))
        real(jobs, stream_min)

    monkeypatch.setattr(K, "copy_batch", spy)
    g = torch.Generator().manual_seed(1)
    src = {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(7, generator=g)}
    total = sum(t.numel() * t.element_size() for t in src.values())
    assert total >= staging.PARALLEL_COPY_MIN_BYTES
    snap = StagingArea(pin_memory=False, copy_threads=2).snapshot(src)
    assert all(torch.equal(snap.tensors[k], v) for k, v in src.items())
    if K.native_available():
        assert sum(n for _, n in seen) == total and len(seen) == 2
        assert len({name for name, _ in seen}) == 2  # really two threads
    seen.clear()
    snap = StagingArea(pin_memory=False, copy_threads=1).snapshot(src)
    assert all(torch.equal(snap.tensors[k], v) for k, v in src.items())
    assert len(seen) == 1


def test_ranks_sharing_a_host_copy_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from mithril_async.save import staging

    monkeypatch.setattr(staging.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert staging.default_copy_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert staging.default_copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")  # unreadable: the process group decides
    assert staging.default_copy_threads() == 2  # none initialised here
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert staging.default_copy_threads() == 1
