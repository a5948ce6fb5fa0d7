"""compress_state_dict's assembly (issue 21): the blob is copied together by every codec thread
at once into one new ``bytes`` object; it must be byte for byte the blob the streaming writer
makes (begin, every block in order, finish, joined), whatever the thread count."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from mithril_async.codec import chunk as chunk_mod
from mithril_async.codec import compress_state_dict, decompress_state_dict
from mithril_async.codec import state_dict as sdm
from mithril_async.codec.chunk import CodecParams, encode_chunk
from mithril_async.codec.container import MckpWriter, TensorEntry
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.errors import CompressionError
from tests.codec._helpers import det_tensor, same_bits


def _state() -> dict[str, Any]:
    """Many small tensors (batched), big ones over several chunks, non-float and empty ones."""
    sd: dict[str, Any] = {f"w{i}": det_tensor("bfloat16" if i % 3 else "float32",
                                              (i * 41 + 3,), i) for i in range(40)}
    sd["big"] = det_tensor("float32", (70_000,), 101)
    sd["half"] = det_tensor("float16", (9_001,), 102)
    sd["steps"] = torch.arange(5_000, dtype=torch.int64)
    sd["mask"] = torch.arange(3_000) % 7 == 0
    sd["empty"] = torch.empty(0)
    sd["np"] = np.linspace(0, 1, 3_000, dtype=np.float32)
    return sd


def _streamed(sd: dict[str, Any], prev: dict[str, Any] | None, params: CodecParams) -> bytes:
    """The reference: the streaming writer fed every chunk in order, its output joined."""
    entries, views = [], []
    for name, value in sd.items():
        raw, dname, shape = tensor_bytes(value)
        base = None
        if prev is not None and name in prev:
            b, bname, bshape = tensor_bytes(prev[name])
            if (bname, bshape) == (dname, shape) and b.size:
                base = b
        entries.append(TensorEntry.make(
            name, dname, shape, params.chunk_bytes,
            None if base is None else xxhash.xxh64_intdigest(base.data),
            {"numpy": True} if isinstance(value, np.ndarray) else None))
        views.append((raw, dname, base))
    w = MckpWriter(entries, params=params, training_step=7, metadata={"k": "v"})
    out = [w.begin()]
    for ti, e in enumerate(entries):
        raw, dname, base = views[ti]
        for ci, (off, ln) in enumerate(e.chunks):
            enc = encode_chunk(raw[off:off + ln], dname,
                               None if base is None else base[off:off + ln], params)
            out.append(w.add(ti, ci, enc))
    out.append(w.finish())
    return b"".join(out)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("delta", [False, True])
def test_blob_is_the_streaming_writers_bytes(threads: int, delta: bool) -> None:
    sd = _state()
    prev = ({k: (v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
             for k, v in sd.items()} if delta else None)
    params = CodecParams(chunk_bytes=1 << 15)
    blob = compress_state_dict(sd, previous=prev, params=params, threads=threads, step=7,
                               metadata={"k": "v"})
    assert type(blob) is bytes
    assert blob == _streamed(sd, prev, params)
    # a fresh bytes object filled in place: its hash is computed from the filled bytes
    assert hash(blob) == hash(bytes(bytearray(blob)))
    out = decompress_state_dict(blob, previous=prev, as_numpy=True)
    assert all(same_bits(out[k], v) for k, v in sd.items())


def test_without_the_c_api_the_parts_are_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _state()
    params = CodecParams(chunk_bytes=1 << 15)
    want = compress_state_dict(sd, params=params, threads=2)
    monkeypatch.setattr(sdm, "_BYTES_API", None)
    assert compress_state_dict(sd, params=params, threads=2) == want


def _parts(seed: int) -> list[Any]:
    """Parts of every kind the writer emits: bytes, memoryviews of arrays, arrays, empties."""
    rng = np.random.default_rng(seed)
    parts: list[Any] = []
    for i in range(60):
        n = int(rng.integers(0, 5000)) if i % 7 else 0
        data = rng.integers(0, 256, n, dtype=np.uint8)
        parts.append([data.tobytes(), memoryview(data), data][i % 3])
    return parts


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_gather_copies_every_byte_once_whatever_the_split(n: int) -> None:
    parts = _parts(n)
    want = b"".join(bytes(memoryview(p)) for p in parts)
    with ThreadPoolExecutor(max(1, n - 1)) as pool:
        got = sdm._gather(parts, len(want), pool if n > 1 else None, n)
    assert type(got) is bytes and got == want


def test_gather_uses_every_thread() -> None:
    """The copy is split over the calling thread and the pool's (the parallel part)."""
    parts: list[Any] = [bytes([i]) * 100_000 for i in range(8)]
    want = b"".join(parts)
    seen: set[int] = set()
    gate = threading.Barrier(2, timeout=30)
    real = sdm._copy_parts

    def spy(*a: Any) -> None:
        seen.add(threading.get_ident())
        gate.wait()  # both ranges are copied at the same time
        real(*a)

    with ThreadPoolExecutor(1) as pool:
        sdm_copy, sdm._copy_parts = sdm._copy_parts, spy  # type: ignore[assignment]
        try:
            got = sdm._gather(parts, 800_000, pool, 2)
        finally:
            sdm._copy_parts = sdm_copy  # type: ignore[assignment]
    assert len(seen) == 2 and got == want
    assert parts == [None] * 8  # each part let go by the thread that copied it


def test_a_failing_chunk_fails_the_call_and_stops_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = chunk_mod.encode_chunk

    def boom(src: Any, dname: str, base: Any, params: CodecParams) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise CompressionError("chunk 3 failed")
        return real(src, dname, base, params)

    monkeypatch.setattr(sdm, "encode_chunk", boom)
    sd = {f"t{i}": det_tensor("float32", (100_000,), i) for i in range(6)}
    before = set(threading.enumerate())
    with pytest.raises(CompressionError, match="chunk 3 failed"):
        compress_state_dict(sd, threads=2, chunk_bytes=1 << 17)
    assert calls >= 3
    # the pool's threads are gone (shut down and joined before the error came out)
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]


def test_coder_sinks_in_order_on_the_pool_threads_whatever_finishes_first() -> None:
    """Job 0 finishes last: nothing is sunk before it, then all in order, by pool threads."""
    release = threading.Event()
    order: list[int] = []
    sinkers: set[int] = set()

    def work(job: list[tuple[int, int]]) -> int:
        if job[0][0] == 0:
            assert release.wait(30)
        return job[0][0] * 10

    def sink(job: list[tuple[int, int]], result: int) -> None:
        assert result == job[0][0] * 10
        order.append(job[0][0])
        sinkers.add(threading.get_ident())

    coder = sdm._Coder(work, sink, 3)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            coder.run()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    try:
        for k in range(8):
            coder.submit([(k, 0)])
        for f in coder._futures[1:]:
            f.result(timeout=30)  # jobs 1..7 done, waiting for job 0
        runner = threading.Thread(target=run)
        runner.start()  # opens the sink: nothing to sink yet (job 0 is not done)
        while not coder._open:
            assert runner.is_alive() or coder._open
            threading.Event().wait(0.001)
        assert order == []
        release.set()
        runner.join(30)
        assert not runner.is_alive() and not errors
    finally:
        release.set()
        coder.close()
    assert order == list(range(8))
    # job 0's pool thread sank all eight; the thread in run() only opened the sink
    assert len(sinkers) == 1 and runner.ident not in sinkers


def test_a_failing_sink_on_a_pool_thread_fails_run() -> None:
    def sink(job: list[tuple[int, int]], result: Any) -> None:
        if job[0][0] == 2:
            raise ValueError("block 2 refused")

    coder = sdm._Coder(lambda job: None, sink, 2)
    try:
        for k in range(6):
            coder.submit([(k, 0)])
        with pytest.raises(ValueError, match="block 2 refused"):
            coder.run()
    finally:
        coder.close()


def test_gather_waits_for_every_copy_even_when_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The result's memory must outlive every thread writing into it: when the calling
    thread's range fails, ``_gather`` still waits for the pool's ranges before raising."""
    go, raised = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def copy(dst: Any, parts: Any, starts: Any, lo: int, hi: int) -> None:
        if lo == 0:
            raised.set()
            raise ValueError("range 0 failed")
        assert go.wait(30)
        seen["pool copy finished"] = True

    monkeypatch.setattr(sdm, "_copy_parts", copy)
    out: list[BaseException] = []
    pool = ThreadPoolExecutor(1)

    def gather() -> None:
        try:
            sdm._gather([bytes(100)] * 4, 400, pool, 2)
        except ValueError as e:
            seen["finished when it raised"] = seen.get("pool copy finished", False)
            out.append(e)

    helper = threading.Thread(target=gather)
    try:
        helper.start()
        assert raised.wait(30)
        go.set()
        helper.join(30)
    finally:
        go.set()
        pool.shutdown()
    assert not helper.is_alive() and out and "range 0 failed" in str(out[0])
    assert seen["finished when it raised"]
