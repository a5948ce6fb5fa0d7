"""The control channel between a training process and its checkpoint worker.

One Unix stream socket (a ``socketpair`` whose far end the worker inherits). Messages are
JSON objects framed by an 8-byte little-endian length, optionally carrying file descriptors
(``SCM_RIGHTS``: the shared-memory segments of the staging buffers), so nothing a peer sends
is ever unpickled. Either side may call the other (:meth:`Channel.call`, answered by the
handler given at construction) and wait for the answer; a reader thread receives frames,
resolves answers and hands calls to the handler. When the peer goes away (EOF, a reset), every
call still waiting fails with :class:`ChannelClosed` and ``on_close`` runs once: a worker
learns that its trainer died, a trainer that its worker did.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from mithril_async.errors import MithrilError
from mithril_async.worker.typed_errors import RemoteError, error_doc, error_of

__all__ = ["Channel", "ChannelClosed", "MAX_FDS", "MAX_FRAME", "RemoteError"]

log = logging.getLogger("mithril_async")

_HEAD = struct.Struct("<Q")
#: the largest message either side accepts (a job lists every staged tensor: far below)
MAX_FRAME = 256 << 20
#: the most descriptors one message carries (the kernel's own limit is 253; a sender with more
#: sends them in several messages). A message that arrives with more is refused: its
#: descriptors are closed and a call is answered with an error naming the limit.
MAX_FDS = 64


class ChannelClosed(MithrilError, ConnectionError):
    """The other process closed the channel (exited, was killed, or closed it)."""


#: ``handler(method, args, fds) -> result``: answers the peer's calls, on the reader thread
#: (it must not block: hand long work to another thread and answer through the future)
Handler = Callable[[str, dict[str, Any], list[int]], "concurrent.futures.Future[Any] | Any"]


class Channel:
    """Calls in both directions over one socket (see the module docstring)."""

    def __init__(self, sock: socket.socket, handler: Handler,
                 on_close: Callable[[], None] | None = None, name: str = "channel") -> None:
        self.sock = sock
        self.handler = handler
        self.on_close = on_close
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._shut_down = False
        self._reader = threading.Thread(target=self._read_loop, name=f"mithril-{name}",
                                        daemon=True)

    def start(self) -> Channel:
        """Start receiving (once the owner is ready to handle calls)."""
        self._reader.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ sending
    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        body = json.dumps(msg, separators=(",", ":"), default=_plain).encode()
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes exceeds {MAX_FRAME}")
        if fds and len(fds) > MAX_FDS:
            raise ValueError(f"a message of {len(fds)} file descriptors exceeds the channel's "
                             f"limit of {MAX_FDS} per message (send them in several)")
        data = _HEAD.pack(len(body)) + body
        with self._send_lock:
            if self._closed:
                raise ChannelClosed("the channel is closed")
            try:
                if fds:
                    sent = socket.send_fds(self.sock, [data], fds)
                    if sent < len(data):
                        self.sock.sendall(data[sent:])
                else:
                    self.sock.sendall(data)
            except OSError as err:
                raise ChannelClosed(f"the peer went away: {err}") from err

    def call(self, method: str, args: dict[str, Any] | None = None,
             fds: list[int] | None = None) -> concurrent.futures.Future[Any]:
        """Ask the peer to run ``method``; the future holds its answer, the error it
        failed with there (:mod:`~mithril_async.worker.typed_errors`), or
        :class:`ChannelClosed`."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            if self._closed:
                fut.set_exception(ChannelClosed("the channel is closed"))
                return fut
            self._waiting[call_id] = fut
        try:
            self._send({"call": method, "id": call_id, "args": args or {}}, fds)
        except BaseException as err:
            with self._lock:
                self._waiting.pop(call_id, None)
            if not fut.done():
                fut.set_exception(err)
        return fut

    def notify(self, method: str, args: dict[str, Any] | None = None) -> None:
        """Tell the peer something; no answer."""
        self._send({"call": method, "id": 0, "args": args or {}})

    def _answer(self, call_id: int, fut: concurrent.futures.Future[Any]) -> None:
        if call_id == 0:
            return
        try:
            exc = fut.exception()
            if exc is None:
                self._send({"reply": call_id, "ok": True, "value": fut.result()})
            else:
                self._send({"reply": call_id, "ok": False, "error": error_doc(exc)})
        except ChannelClosed:
            pass
        except Exception:  # an answer that cannot be sent is the peer's loss; say so here
            log.exception("could not answer call %d", call_id)

    # ------------------------------------------------------------------ receiving
    def _recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError
            out += chunk
        return bytes(out)

    def _read_one(self) -> tuple[dict[str, Any], list[int], bool]:
        """The next message, its descriptors, and whether it carried more than ``MAX_FDS``
        (then it comes with none: the kernel dropped those beyond the limit and the others
        are closed here)."""
        head, fds, flags, _addr = socket.recv_fds(self.sock, _HEAD.size, MAX_FDS)
        truncated = bool(flags & socket.MSG_CTRUNC)
        if truncated or not head:
            for fd in fds:
                os.close(fd)
            fds = []
        if not head:
            raise EOFError
        try:
            if len(head) < _HEAD.size:
                head += self._recv_exact(_HEAD.size - len(head))
            (n,) = _HEAD.unpack(head)
            if n > MAX_FRAME:
                raise ValueError(f"a message of {n} bytes exceeds {MAX_FRAME}")
            msg = json.loads(self._recv_exact(n))
            if not isinstance(msg, dict):
                raise ValueError("a message that is not a JSON object")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return msg, list(fds), truncated

    def _read_loop(self) -> None:
        try:
            while True:
                msg, fds, truncated = self._read_one()
                if truncated:
                    self._refuse(msg)
                elif "reply" in msg:
                    self._deliver(msg)
                else:
                    self._dispatch(msg, fds)
        except (EOFError, OSError, ValueError) as err:
            if not self._closed and not isinstance(err, EOFError):
                log.warning("checkpoint channel: %r", err)
        finally:
            self._shut()

    def _deliver(self, msg: dict[str, Any]) -> None:
        with self._lock:
            fut = self._waiting.pop(int(msg["reply"]), None)
        if fut is None or fut.done():
            return
        if msg.get("ok"):
            fut.set_result(msg.get("value"))
        else:
            doc = msg.get("error")
            fut.set_exception(error_of(doc) if isinstance(doc, dict)
                              else RemoteError("unknown", "the peer's answer named no error"))

    def _refuse(self, msg: dict[str, Any]) -> None:
        """A message that carried more descriptors than ``MAX_FDS`` (all closed by now): a
        call is answered with an error naming the limit, a reply fails its call, anything
        else is logged."""
        err = ValueError(f"a message carried more than {MAX_FDS} file descriptors, the "
                         "channel's limit per message; it was refused and its descriptors "
                         "closed")
        if "reply" in msg:
            with self._lock:
                fut = self._waiting.pop(int(msg["reply"]), None)
            if fut is not None and not fut.done():
                fut.set_exception(err)
            return
        call_id = int(msg.get("id", 0)) if "call" in msg else 0
        if call_id == 0:
            log.warning("checkpoint channel: %s", err)
            return
        refused: concurrent.futures.Future[Any] = concurrent.futures.Future()
        refused.set_exception(err)
        self._answer(call_id, refused)

    def _dispatch(self, msg: dict[str, Any], fds: list[int]) -> None:
        call_id = int(msg.get("id", 0))
        try:
            got = self.handler(str(msg["call"]), dict(msg.get("args") or {}), fds)
        except BaseException as err:
            got = concurrent.futures.Future()
            got.set_exception(err)
        if not isinstance(got, concurrent.futures.Future):
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(got)
            got = done
        got.add_done_callback(lambda f: self._answer(call_id, f))

    # ------------------------------------------------------------------ closing
    def _shut(self) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = self._closed = True
            waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(ChannelClosed("the other process went away"))
        if self.on_close is not None:
            cb, self.on_close = self.on_close, None
            cb()

    def close(self) -> None:
        """Close the socket; calls still waiting fail with :class:`ChannelClosed`."""
        with self._send_lock:
            self._closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        self._shut()


def _plain(value: Any) -> Any:
    """JSON for what training code passes as metrics (numpy and torch scalars)."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
