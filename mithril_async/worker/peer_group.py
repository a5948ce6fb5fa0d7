"""The checkpoint workers of a multi-rank job as a group: connections, waits, failures.

Rank 0's worker accepts a connection from every other rank's worker on the socket its trainer
handed it; a connecting worker says who it is (rank, the job's secret) before anything else
is read. Each message that arrives wakes whatever waits (:meth:`PeerGroup._until`, bounded by
the group's timeout); a connection that ends fails the save in flight at once, and a save
that ends here before its protocol did tells the others (``abort``). The protocol's steps
themselves: :class:`~mithril_async.worker.peers.PeerCoordinator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mithril_async.errors import DistributedError
from mithril_async.worker.peer_links import HELLO_MAX, MAX_FRAME, Conn

__all__ = ["Broken", "PeerGroup", "SaveRun"]

log = logging.getLogger("mithril_async")

#: seconds a leaving worker gives its last messages to go out
_LEAVE_S = 5.0


@dataclass
class SaveRun:
    """One save's protocol as this worker runs it."""

    token: str
    step: int | None
    #: the connection each other rank takes part over (rank 0: every rank; others: rank 0)
    via: dict[int, Conn] = field(default_factory=dict)
    #: rank 0: what each rank sent
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    layouts: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: why the save can no longer commit (a rank went away or gave up)
    failed: str | None = None
    #: the protocol is over here (outcome sent or received, or failed)
    done: bool = False


class Broken(Exception):
    """A wait's condition can never hold: why."""


class PeerGroup:
    """The checkpoint workers of a job as a group: rank 0 accepts, the others connect
    (:mod:`~mithril_async.worker.peers` says what they exchange).

    ``address``: what :func:`rendezvous` gave (host, port, secret, timeout_s); ``listener``:
    rank 0's listening socket. :meth:`start` on the worker's event loop first; one save at a
    time, each inside :meth:`save`."""

    def __init__(self, rank: int, world_size: int, address: dict[str, Any],
                 listener: socket.socket | None = None) -> None:
        if rank == 0 and listener is None:
            raise ValueError("rank 0's checkpoint worker needs the listening socket")
        self.rank, self.world_size = rank, world_size
        self.host, self.port = str(address["host"]), int(address["port"])
        self._secret = str(address["secret"])
        self.timeout_s = float(address["timeout_s"])
        self._listener = listener
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: rank 0: each other rank's connection, and why a rank left for good
        self._conns: dict[int, Conn] = {}
        self._left: dict[int, str] = {}
        #: other ranks: the connection to rank 0 and what came over it, in order
        self._up: Conn | None = None
        self._inbox: list[dict[str, Any]] = []
        self._connecting = asyncio.Lock()
        #: the save in flight: its step and its protocol
        self._step: int | None = None
        self._run: SaveRun | None = None

    # ------------------------------------------------------------ set-up and end
    async def start(self) -> None:
        """On the worker's loop: rank 0 accepts the other workers; another rank connects
        (if rank 0 is not reachable yet, its next save tries again)."""
        self._loop = asyncio.get_running_loop()
        if self._listener is not None:
            self._server = await asyncio.start_server(self._accept, sock=self._listener,
                                                      backlog=socket.SOMAXCONN)
            return
        self._spawn(self._connect_quietly())

    def close(self) -> None:
        """Leave the group (from any thread): a worker that exits says so and ends its
        connections, after giving its last messages a moment to go out."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            if self._listener is not None:
                self._listener.close()
            return
        fut = asyncio.run_coroutine_threadsafe(self._leave(), loop)
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:  # on the loop itself it runs once this caller returns
            with contextlib.suppress(Exception):
                fut.result(_LEAVE_S * 2)

    async def _leave(self) -> None:
        if self._server is not None:
            self._server.close()
        conns = [c for c in [*self._conns.values(), self._up] if c is not None]
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.post({"op": "bye", "why": "its training process is gone"})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(c.flush(_LEAVE_S) for c in conns),
                                                  return_exceptions=True), _LEAVE_S)
        for conn in conns:
            conn.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=_LEAVE_S)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kick(self) -> None:
        """Something a wait may be waiting for changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ------------------------------------------------------------ connections
    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Rank 0: a worker connects; it must say which rank it is and know the secret."""
        conn = Conn(reader, writer, None)
        try:
            hello = await asyncio.wait_for(conn.recv(HELLO_MAX), self.timeout_s)
            rank = hello.get("rank")
            if (hello.get("op") != "hello" or type(rank) is not int
                    or not 0 < rank < self.world_size
                    or not hmac.compare_digest(str(hello.get("secret")).encode(),
                                               self._secret.encode())):
                raise ValueError("not a checkpoint worker of this job")
        except Exception as err:  # ended before saying who it is: a worker that died
            level = (logging.DEBUG if isinstance(err, asyncio.IncompleteReadError)
                     else logging.WARNING)
            log.log(level, "checkpoint workers: refused a connection from %s: %r",
                    writer.get_extra_info("peername"), err)
            conn.close()
            return
        conn.peer = rank
        old = self._conns.get(rank)
        self._conns[rank] = conn
        self._left.pop(rank, None)
        if old is not None:  # a new worker of that rank: the old one is gone
            old.close()
        self._kick()
        await self._read(conn)

    async def _connect_quietly(self) -> None:
        with contextlib.suppress(DistributedError):
            await self._connection("connect")

    async def _connection(self, what: str) -> Conn:
        """Another rank: the connection to rank 0's worker, made if there is none."""
        async with self._connecting:
            if self._up is not None and self._up.lost is None:
                return self._up
            where = f"rank 0's checkpoint worker at {self.host}:{self.port}"
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), self.timeout_s)
                conn = Conn(reader, writer, 0)
                conn.post({"op": "hello", "rank": self.rank, "secret": self._secret})
                await conn.flush(self.timeout_s)
            except (OSError, TimeoutError) as err:
                raise self._fail(what, f"could not reach {where}: "
                                       f"{type(err).__name__}: {err}") from None
            self._up, self._inbox = conn, []
            self._spawn(self._read(conn))
            return conn

    async def _read(self, conn: Conn) -> None:
        """Receive ``conn``'s messages until it ends."""
        why = "connection closed"
        try:
            while True:
                self._take(conn, await conn.recv(MAX_FRAME))
                self._kick()
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as err:
            if not isinstance(err, asyncio.IncompleteReadError):
                why = f"{type(err).__name__}: {err}"
        except Exception as err:  # bad frames: the peer is not speaking this protocol
            why = f"bad message: {type(err).__name__}: {err}"
            log.warning("checkpoint workers: rank %s sent %s", conn.peer, why)
        finally:
            conn.lost = why
            conn.close()
            self._gone(conn)
            self._kick()

    def _take(self, conn: Conn, msg: dict[str, Any]) -> None:
        if self.rank != 0:
            if conn is self._up:
                self._inbox.append(msg)
            return
        rank = conn.peer
        assert rank is not None
        if msg["op"] == "bye":
            self._left[rank] = str(msg.get("why"))
            return
        run = self._run
        if run is None or msg.get("save") != run.token or run.via.get(rank) is not conn:
            return  # an older save's
        if msg["op"] == "part":
            run.parts[rank] = msg
        elif msg["op"] == "layouts":
            run.layouts[rank] = msg
        elif msg["op"] == "abort":
            run.failed = run.failed or f"rank {rank} gave up the save: {msg.get('error')}"

    def _gone(self, conn: Conn) -> None:
        rank = conn.peer
        if self.rank != 0 or rank is None:
            return
        if self._conns.get(rank) is conn:
            del self._conns[rank]
        run = self._run
        if run is not None and run.via.get(rank) is conn and run.failed is None:
            left = self._left.get(rank)
            run.failed = (f"rank {rank}'s checkpoint worker exited ({left})" if left else
                          f"rank {rank}'s checkpoint worker went away ({conn.lost})")

    # ------------------------------------------------------------ waiting and failing
    async def _until(self, what: str, ready: Callable[[], Any],
                     waiting: Callable[[], str] | None = None) -> Any:
        """Wait (bounded by the timeout) until ``ready()`` returns something other than
        None; it raises :class:`Broken` if it never will."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            changed = self._changed
            try:
                got = ready()
            except Broken as err:
                raise self._fail(what, str(err)) from None
            if got is not None:
                return got
            left = deadline - loop.time()
            if left <= 0:
                why = f"timed out after {self.timeout_s:g}s"
                raise self._fail(what, f"{why} waiting for {waiting()}" if waiting else why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def _fail(self, what: str, why: str) -> DistributedError:
        msg = (f"rank {self.rank}/{self.world_size}: {what} failed ({why}); a peer rank died, "
               "hung, or failed before reaching this step")
        run = self._run
        if run is not None and not run.done:
            self._abort(run, why)
        return DistributedError(msg)

    def _abort(self, run: SaveRun, why: str) -> None:
        """The save cannot commit: every other rank taking part learns it at once."""
        run.done = True
        for conn in run.via.values():
            with contextlib.suppress(Exception):
                conn.post({"op": "abort", "save": run.token, "error": f"rank {self.rank}: {why}"})

    def _current(self, what: str) -> SaveRun:
        run = self._run
        if run is None or run.done:
            raise self._fail(what, "no save of this worker agreed on a version")
        return run

    @contextlib.asynccontextmanager
    async def save(self, step: int) -> AsyncIterator[None]:
        """One save of ``step`` runs inside: if it ends before its protocol (an error, a
        cancel) the other ranks learn it at once instead of at their timeout."""
        self._step, self._run = step, None
        why = "the save ended before its rank protocol did"
        try:
            yield
        except BaseException as err:
            why = ("the save was cancelled" if isinstance(err, asyncio.CancelledError)
                   else f"{type(err).__name__}: {err}")
            raise
        finally:
            run, self._run, self._step = self._run, None, None
            if run is not None and not run.done:
                self._abort(run, why)
