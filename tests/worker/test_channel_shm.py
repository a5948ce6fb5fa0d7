"""The worker's control channel and shared staging memory, on their own."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
from typing import Any

import pytest
import torch

from mithril_async.errors import ChecksumMismatch, NonFiniteState, WorkerExited
from mithril_async.worker.channel import Channel, ChannelClosed, RemoteError
from mithril_async.worker.handoff import error_doc, error_of
from mithril_async.worker.shm import BufferAt, SegmentMap, SharedArena


def _pair(handler_a: Any, handler_b: Any, on_close_b: Any = None) -> tuple[Channel, Channel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return (Channel(a, handler_a).start(), Channel(b, handler_b, on_close=on_close_b).start())


def test_calls_go_both_ways_with_answers_errors_and_descriptors() -> None:
    got_fds: list[int] = []

    def b_handler(method: str, args: dict[str, Any], fds: list[int]) -> Any:
        if method == "add":
            return args["x"] + args["y"]
        if method == "fds":
            got_fds.extend(fds)
            return [os.fstat(fd).st_size for fd in fds]
        raise KeyError(method)

    def a_handler(method: str, args: dict[str, Any], fds: list[int]) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        threading.Thread(target=lambda: fut.set_result(f"a says {args['w']}")).start()
        return fut  # answered later, from another thread

    a, b = _pair(a_handler, b_handler)
    try:
        assert a.call("add", {"x": 2, "y": 40}).result(10) == 42
        assert b.call("echo", {"w": "hi"}).result(10) == "a says hi"
        with pytest.raises(RemoteError, match="KeyError") as err:
            a.call("nothing").result(10)
        assert err.value.kind == "KeyError"
        r, w = os.pipe()
        fd = os.memfd_create("t")
        os.ftruncate(fd, 12345)
        assert a.call("fds", {}, [fd]).result(10) == [12345]
        assert len(got_fds) == 1 and got_fds[0] != fd  # a descriptor of its own
        for f in (r, w, fd, *got_fds):
            os.close(f)
    finally:
        a.close()
        b.close()


def test_a_peer_going_away_fails_waiting_calls_and_is_reported() -> None:
    gone = threading.Event()

    def slow(method: str, args: dict[str, Any], fds: list[int]) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        return fut  # never answered

    a, b = _pair(slow, slow, on_close_b=gone.set)
    waiting = a.call("forever")
    b2 = b.call("x")
    a.close()  # the trainer dies: b learns it, a's waiting call fails
    assert gone.wait(10)
    with pytest.raises(ChannelClosed):
        waiting.result(10)
    with pytest.raises(ChannelClosed):
        b2.result(10)
    with pytest.raises(ChannelClosed):
        b.call("after").result(10)
    b.close()


def test_the_arena_hands_out_shared_buffers_another_mapping_sees() -> None:
    arena = SharedArena(segment_bytes=1 << 20)
    small = arena.buffer((10, 3), torch.float32)
    big = arena.buffer((600_000,), torch.bfloat16)  # larger than a segment: one of its own
    empty = arena.buffer((0, 4), torch.float32)
    assert arena.locate(empty) is None and empty.shape == (0, 4)
    at_small, at_big = arena.locate(small), arena.locate(big)
    assert at_small is not None and at_big is not None and at_small.segment != at_big.segment
    assert arena.locate(torch.zeros(3)) is None
    segments = arena.unsent(1)
    assert {s for s, _, _ in segments} == {at_small.segment, at_big.segment}
    for _, fd, _ in segments:  # anonymous memory: no name anywhere to be left behind
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:mithril")
    assert arena.unsent(1) == []  # sent once per channel
    assert len(arena.unsent(2)) == 2  # a new worker gets them all again
    seen = SegmentMap()
    seen.add([(s, n) for s, _, n in segments], [os.dup(fd) for _, fd, _ in segments])
    small.copy_(torch.arange(30, dtype=torch.float32).reshape(10, 3))
    view = seen.view(at_small, torch.float32, (10, 3))
    assert torch.equal(view, small)
    view[0, 0] = -1.0  # one memory, seen from both sides
    assert small[0, 0] == -1.0
    with pytest.raises(ValueError, match="never sent"):
        seen.view(BufferAt(99, 0), torch.float32, (1,))
    with pytest.raises(ValueError, match="does not fit"):
        seen.view(BufferAt(at_small.segment, (1 << 20) - 4), torch.float32, (4,))
    with pytest.raises(ValueError, match="2 segments described, 1 descriptors"):
        seen.add([(1, 10), (2, 10)], [os.memfd_create("x")])
    arena.close()


def test_errors_cross_as_their_own_type() -> None:
    err = error_of(error_doc(OSError(28, "No space left on device")))
    assert type(err) is OSError and err.errno == 28
    got = error_of(error_doc(WorkerExited("the worker was killed by SIGKILL")))
    assert isinstance(got, WorkerExited) and "SIGKILL" in str(got)
    assert type(error_of({"kind": "Sneaky", "message": "x"})).__name__ == "MithrilError"
    # what the library's errors carry besides the message crosses too (through JSON)
    doc = json.loads(json.dumps(error_doc(NonFiniteState("1 Inf", {"model/w": (0, 1)}))))
    nf = error_of(doc)
    assert isinstance(nf, NonFiniteState) and nf.tensors == {"model/w": (0, 1)}
    cm = error_of(json.loads(json.dumps(error_doc(ChecksumMismatch("k", "aa", "bb")))))
    assert isinstance(cm, ChecksumMismatch) and (cm.where, cm.expected, cm.actual) == (
        "k", "aa", "bb")
    assert error_of({"kind": "NonFiniteState", "message": "m", "details": {
        "tensors": {"x": ["no", 1], "y": [2, 3]}}}).tensors == {"y": (2, 3)}  # type: ignore[attr-defined]
