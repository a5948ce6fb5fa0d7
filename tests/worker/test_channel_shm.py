"""The worker's control channel and shared staging memory, on their own."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import threading
from typing import Any

import numpy as np
import pytest
import torch

from mithril_async.errors import ChecksumMismatch, ConfigError, NonFiniteState, WorkerExited
from mithril_async.worker.arena import SharedArena
from mithril_async.worker.channel import Channel, ChannelClosed, RemoteError
from mithril_async.worker.handoff import error_doc, error_of
from mithril_async.worker.shm import BufferAt, SegmentMap


class _OddError(Exception):
    """An exception class the receiving side must not try to rebuild."""


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
        if method == "config":
            raise ConfigError("checkpointing.pipeline.process: a typed error of the library")
        if method == "odd":
            raise _OddError("a class only this process knows")
        raise KeyError(method)

    def a_handler(method: str, args: dict[str, Any], fds: list[int]) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        threading.Thread(target=lambda: fut.set_result(f"a says {args['w']}")).start()
        return fut  # answered later, from another thread

    a, b = _pair(a_handler, b_handler)
    try:
        assert a.call("add", {"x": 2, "y": 40}).result(10) == 42
        assert b.call("echo", {"w": "hi"}).result(10) == "a says hi"
        # errors keep their class across the channel: the library's, builtins
        with pytest.raises(KeyError, match="nothing"):
            a.call("nothing").result(10)
        with pytest.raises(ConfigError, match=r"checkpointing\.pipeline\.process"):
            a.call("config").result(10)
        with pytest.raises(RemoteError, match="_OddError: a class only") as err:
            a.call("odd").result(10)  # never a class looked up anywhere else
        assert err.value.kind == "_OddError"
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
    assert len(arena.unsent(1)) == 2  # until its peer acknowledged them
    arena.mark_sent(1, [s for s, _, _ in segments])
    assert arena.unsent(1) == []  # sent once per channel
    assert len(arena.unsent(2)) == 2  # a new worker gets them all again
    seen = SegmentMap()
    seen.add([(s, n) for s, _, n in segments], [os.dup(fd) for _, fd, _ in segments])
    small.copy_(torch.arange(30, dtype=torch.float32).reshape(10, 3))
    view = seen.view(at_small, "float32", (10, 3))  # bytes, as the worker sees them
    assert (view.dtype, view.shape) == ("float32", (10, 3))
    assert view.data.tobytes() == small.numpy().tobytes()
    view.data.view(np.float32)[0] = -1.0  # one memory, seen from both sides
    assert small[0, 0] == -1.0
    with pytest.raises(ValueError, match="never sent"):
        seen.view(BufferAt(99, 0), "float32", (1,))
    with pytest.raises(ValueError, match="does not fit"):
        seen.view(BufferAt(at_small.segment, (1 << 20) - 4), "float32", (4,))
    with pytest.raises(ValueError, match="2 segments described, 1 descriptors"):
        seen.add([(1, 10), (2, 10)], [os.memfd_create("x")])
    arena.close()


def test_errors_cross_as_their_own_type() -> None:
    err = error_of(error_doc(OSError(28, "No space left on device")))
    assert type(err) is OSError and err.errno == 28
    got = error_of(error_doc(WorkerExited("the worker was killed by SIGKILL")))
    assert isinstance(got, WorkerExited) and "SIGKILL" in str(got)
    sneaky = error_of({"kind": "Sneaky", "message": "x"})  # no class of that name is made
    assert type(sneaky) is RemoteError and sneaky.kind == "Sneaky"
    # what the library's errors carry besides the message crosses too (through JSON)
    doc = json.loads(json.dumps(error_doc(NonFiniteState("1 Inf", {"model/w": (0, 1)}))))
    nf = error_of(doc)
    assert isinstance(nf, NonFiniteState) and nf.tensors == {"model/w": (0, 1)}
    cm = error_of(json.loads(json.dumps(error_doc(ChecksumMismatch("k", "aa", "bb")))))
    assert isinstance(cm, ChecksumMismatch) and (cm.where, cm.expected, cm.actual) == (
        "k", "aa", "bb")
    assert error_of({"kind": "NonFiniteState", "message": "m", "details": {
        "tensors": {"x": ["no", 1], "y": [2, 3]}}}).tensors == {"y": (2, 3)}  # type: ignore[attr-defined]


def _memfds_named(name: str) -> int:
    """How many of this process's descriptors are memfds called ``name``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
    return count


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    head = b""
    while len(head) < 8:
        head += sock.recv(8 - len(head))
    n = int.from_bytes(head, "little")
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return dict(json.loads(body))


def _frame(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg).encode()
    return len(body).to_bytes(8, "little") + body


def test_a_message_over_the_descriptor_limit_is_refused_with_its_descriptors_closed() -> None:
    """More descriptors than the channel takes in one message: the call is answered with an
    error naming the limit, the handler never sees a truncated list, every descriptor is
    closed (none left in this process once the sender closes its own), and the channel goes
    on; a sender never writes such a message (a typed error before anything is sent)."""
    from mithril_async.worker.channel import MAX_FDS

    got: list[int] = []

    def handler(method: str, args: dict[str, Any], fds: list[int]) -> Any:
        got.append(len(fds))
        for fd in fds:
            os.close(fd)
        return len(fds)

    raw, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    chan = Channel(theirs, handler).start()
    mine = [os.memfd_create("toomany") for _ in range(MAX_FDS + 36)]
    try:
        socket.send_fds(raw, [_frame({"call": "take", "id": 7, "args": {}})], mine)
        answer = _read_frame(raw)
        assert answer["reply"] == 7 and answer["ok"] is False
        assert answer["error"]["kind"] == "ValueError"
        assert f"more than {MAX_FDS}" in answer["error"]["message"]
        assert got == []  # never handed a truncated list
        for fd in mine:
            os.close(fd)
        mine = []
        assert _memfds_named("toomany") == 0  # the receiver kept none of them
        ok = [os.memfd_create("fine") for _ in range(MAX_FDS)]
        socket.send_fds(raw, [_frame({"call": "take", "id": 8, "args": {}})], ok)
        assert _read_frame(raw) == {"reply": 8, "ok": True, "value": MAX_FDS}
        for fd in ok:
            os.close(fd)
        assert _memfds_named("fine") == 0
        assert not chan.closed
        a, b = _pair(handler, handler)
        over = [os.memfd_create("oversend") for _ in range(MAX_FDS + 1)]
        try:
            with pytest.raises(ValueError, match=f"limit of {MAX_FDS} per message"):
                a.call("take", {}, over).result(10)
            assert a.call("take", {}, over[:2]).result(10) == 2  # still open
        finally:
            for fd in over:
                os.close(fd)
            a.close()
            b.close()
        assert _memfds_named("oversend") == 0
    finally:
        for fd in mine:
            os.close(fd)
        raw.close()
        chan.close()


def test_segments_grow_so_a_huge_state_takes_few_descriptors() -> None:
    """Segments grow with what the arena holds: 100 GiB of staging buffers (memfds are
    sparse: nothing here is touched, so it costs no memory) take far fewer descriptors than
    the usual soft limit of 1024 open files, each segment at most 16 times the first ones'
    size unless one buffer needs more."""
    from mithril_async.worker.shm import SEGMENT_BYTES

    arena = SharedArena()
    bufs = []
    try:
        for _ in range(1100):  # 96 MiB tensors (a GPT-like layer's weight): 103 GiB
            bufs.append(arena.buffer((48 << 20,), torch.bfloat16))
        segments = arena.unsent(1)
        assert arena.nbytes >= 100 << 30
        assert len(segments) < 200
        sizes = [n for _, _, n in segments]
        assert min(sizes) >= SEGMENT_BYTES and max(sizes) <= 16 * SEGMENT_BYTES
    finally:
        del bufs
        arena.close()
    fixed = SharedArena(segment_bytes=4096, max_segment_bytes=4096)  # no growth
    small = [fixed.buffer((1000,), torch.float32) for _ in range(50)]
    assert len(fixed.unsent(1)) == 50 and {n for _, _, n in fixed.unsent(1)} == {4096}
    del small
    fixed.close()
