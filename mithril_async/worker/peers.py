"""The rank protocol among the checkpoint workers of a multi-rank job: a group of their own.

Why: a save handed to a worker no longer depends on its trainer, so the protocol's steps
(agree on the version, gather every rank's part, the outcome) must not either: a preemption
that kills every trainer of a job once its grace period is over must leave the workers able to
commit the save every rank handed over. So the workers run the protocol among themselves.

How: a star over TCP. Rank 0's trainer opens a listening socket when its manager is made
(bound to the job's address for rank 0: ``MASTER_ADDR``, else this host's address; port 0)
and every rank learns its address and a secret in one broadcast on the trainers' checkpoint
group (:mod:`~mithril_async.worker.peer_links`: the socket, the rendezvous, the framed
connections). Rank 0's trainer hands that socket to each worker it starts, so the address
outlives a restarted worker; every other worker connects to it and says who it is (rank,
secret). A save's steps are then messages: ``agree`` (rank 0 to all: the version
number, or why there is none), ``part`` (to rank 0, without piece layouts), ``want`` (rank 0
to all: the layouts it lacks, each from the lowest rank naming it, as
:class:`~mithril_async.distributed.DistCoordinator` gathers them), ``layouts`` (to rank 0),
``outcome`` (rank 0 to all), then what a layer commits along with the save (``value``,
rank 0 to all: the tier manifest).

Pairing: rank 0 names each save with a fresh token in its ``agree`` message and every later
message of that save carries it; a rank takes the ``agree`` of the step it is saving and drops
older ones (a save it never ran), so a save that one rank never ran fails alone.

Failures, as with ``DistCoordinator``: every wait is bounded by the checkpoint group's
timeout, and a failure is a :class:`~mithril_async.errors.DistributedError` naming the step
and the rank. Beyond it: a connection that breaks fails the save in flight at once on both
ends; a save that ends on one rank before its protocol did (an error, a cancel) tells the
others (``abort``); a worker leaving because its trainer is gone says so (``bye``), so rank 0
fails later saves at once instead of waiting for a worker that will not come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from mithril_async.errors import DistributedError
from mithril_async.manifest import PieceLayout, gc_paused
from mithril_async.pipeline.coordinator import (
    Coordinator,
    Outcome,
    RankPart,
    compact_part,
    layout_senders,
    with_layouts,
)
from mithril_async.worker.peer_links import HELLO_MAX, MAX_FRAME, Conn, rendezvous

__all__ = ["PeerCoordinator", "rendezvous", "save_scope"]


log = logging.getLogger("mithril_async")

#: seconds a leaving worker gives its last messages to go out
_LEAVE_S = 5.0


@dataclass
class _Run:
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


class _Broken(Exception):
    """A wait's condition can never hold: why."""


class PeerCoordinator:
    """The rank protocol's collectives among the job's checkpoint workers (module doc).

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
        self._run: _Run | None = None

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
        None; it raises :class:`_Broken` if it never will."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            changed = self._changed
            try:
                got = ready()
            except _Broken as err:
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

    def _abort(self, run: _Run, why: str) -> None:
        """The save cannot commit: every other rank taking part learns it at once."""
        run.done = True
        for conn in run.via.values():
            with contextlib.suppress(Exception):
                conn.post({"op": "abort", "save": run.token, "error": f"rank {self.rank}: {why}"})

    def _current(self, what: str) -> _Run:
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

    # ------------------------------------------------------------ the protocol
    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        if self.rank == 0:
            return await self._agree_root(claim)
        what = "agree_version"
        conn = await self._connection(what)
        step = self._step

        def agreed() -> dict[str, Any] | None:
            for i, msg in enumerate(self._inbox):
                if msg["op"] == "agree" and msg.get("step") == step:
                    del self._inbox[:i + 1]  # and every older save's messages
                    return msg
            if conn.lost is not None:
                raise _Broken(f"rank 0's checkpoint worker went away ({conn.lost})")
            return None

        msg = await self._until(what, agreed, lambda: "rank 0's version number")
        run = self._run = _Run(str(msg.get("save")), step, via={0: conn})
        number, error = msg.get("number"), msg.get("error")
        if error is not None or type(number) is not int:
            run.done = True
            raise DistributedError(str(error or "rank 0 sent no version number"))
        return number

    async def _agree_root(self, claim: Callable[[], Awaitable[int]]) -> int:
        what = "agree_version"
        others = range(1, self.world_size)
        gone = [r for r in others if r in self._left]
        if gone:  # before claiming: nothing is left behind
            raise self._fail(what, f"rank {gone[0]}'s checkpoint worker exited "
                                   f"({self._left[gone[0]]})")
        number: int | None = None
        error: str | None = None
        try:
            number = await claim()
        except Exception as err:
            error = f"rank 0 could not claim a version: {type(err).__name__}: {err}"
        run = _Run(secrets.token_hex(8), self._step)

        def connected() -> bool | None:
            left = [r for r in others if r in self._left]
            if left:
                raise _Broken(f"rank {left[0]}'s checkpoint worker exited "
                              f"({self._left[left[0]]})")
            return True if all(r in self._conns for r in others) else None

        failure: DistributedError | None = None
        try:
            await self._until(what, connected, lambda: "the checkpoint workers of rank(s) "
                              + ", ".join(str(r) for r in others if r not in self._conns)
                              + " to connect")
        except DistributedError as err:
            failure = err
            error = error or str(err)
        # the ranks connected take part (told of a failure too, so none waits for it)
        run.via, self._run = dict(self._conns), run
        msg = {"op": "agree", "save": run.token, "step": run.step, "number": number,
               "error": error}
        for conn in run.via.values():
            with contextlib.suppress(Exception):
                conn.post(msg)
        if error is not None or number is None:
            run.done = True
            raise failure or DistributedError(error or "rank 0 claimed no version")
        return number

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        part = compact_part(part)
        if self.rank != 0:
            await self._send_part(part)
            return None
        run = self._current("gather_parts")
        others = range(1, self.world_size)

        def arrived(got: dict[int, Any], ranks: Any) -> Callable[[], bool | None]:
            def check() -> bool | None:
                if run.failed is not None:
                    raise _Broken(run.failed)
                return True if all(r in got for r in ranks) else None
            return check

        def missing(got: dict[int, Any], ranks: Any) -> Callable[[], str]:
            return lambda: "rank(s) " + ", ".join(str(r) for r in ranks if r not in got)

        await self._until("gather_parts", arrived(run.parts, others),
                          missing(run.parts, others))
        parts = [part.model_copy(update={"layouts": {}})]
        with gc_paused():
            for r in others:
                parts.append(self._valid_part(r, run.parts[r].get("part")))
        senders = layout_senders(parts)
        for r in others:
            with contextlib.suppress(Exception):
                run.via[r].post({"op": "want", "save": run.token,
                                 "layouts": sorted(i for i, s in senders.items() if s == r)})
        asked = sorted({s for s in senders.values() if s != 0})
        await self._until("gather_parts:layouts", arrived(run.layouts, asked),
                          missing(run.layouts, asked))
        layouts = {lid: part.layouts[lid] for lid, s in senders.items() if s == 0}
        try:
            with gc_paused():
                for r in asked:
                    sent = run.layouts[r].get("layouts")
                    for lid, doc in (sent if isinstance(sent, dict) else {}).items():
                        if senders.get(lid) == r:
                            layouts[lid] = PieceLayout.model_validate(doc)
            return with_layouts(parts, layouts)
        except (ValidationError, DistributedError) as err:
            raise self._fail("gather_parts:layouts", f"{type(err).__name__}: {err}") from None

    def _valid_part(self, rank: int, doc: Any) -> RankPart:
        try:
            got = RankPart.model_validate(doc)
        except ValidationError as err:
            raise self._fail("gather_parts", f"rank {rank} sent no valid part: {err}") from None
        if got.rank != rank:
            raise self._fail("gather_parts", f"rank {rank} sent rank {got.rank}'s part")
        return got

    async def _send_part(self, part: RankPart) -> None:
        run = self._current("gather_parts")
        conn = run.via[0]
        try:
            conn.post({"op": "part", "save": run.token,
                       "part": part.model_dump(mode="json", exclude={"layouts"})})
        except ConnectionError as err:
            raise self._fail("gather_parts", f"rank 0's checkpoint worker went away ({err})"
                             ) from None
        want = await self._until("gather_parts", self._reply(run, "want"),
                                 lambda: "rank 0's list of piece layouts")
        ids = want.get("layouts")
        mine = {lid: part.layouts[lid].model_dump(mode="json")
                for lid in (ids if isinstance(ids, list) else []) if lid in part.layouts}
        try:
            conn.post({"op": "layouts", "save": run.token, "layouts": mine})
        except ConnectionError as err:
            raise self._fail("gather_parts:layouts",
                             f"rank 0's checkpoint worker went away ({err})") from None

    def _reply(self, run: _Run, op: str) -> Callable[[], dict[str, Any] | None]:
        """Another rank: rank 0's ``op`` message of ``run`` (or its abort)."""
        conn = run.via[0]

        def check() -> dict[str, Any] | None:
            for i, msg in enumerate(self._inbox):
                if msg.get("save") == run.token and msg["op"] in (op, "abort"):
                    del self._inbox[i]
                    if msg["op"] == "abort":
                        run.done = True
                        raise _Broken(f"the save failed on {msg.get('error')}")
                    return msg
            if conn.lost is not None:
                raise _Broken(f"rank 0's checkpoint worker went away ({conn.lost})")
            return None
        return check

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        what = "broadcast_outcome"
        run = self._current(what)
        if self.rank != 0:
            msg = await self._until(what, self._reply(run, "outcome"),
                                    lambda: "rank 0's outcome")
            run.done = True
            try:
                return Outcome.model_validate(msg.get("outcome"))
            except ValidationError as err:
                raise DistributedError(f"rank {self.rank}: rank 0 sent no valid outcome: "
                                       f"{err}") from None
        if outcome is None:
            raise self._fail(what, "rank 0 has no outcome to send")
        run.done = True
        sent = {"op": "outcome", "save": run.token, "outcome": outcome.model_dump(mode="json")}
        conns = list(run.via.values())
        for conn in conns:  # a rank gone by now cannot change the outcome
            with contextlib.suppress(Exception):
                conn.post(sent)
        await asyncio.gather(*(c.flush(self.timeout_s) for c in conns), return_exceptions=True)
        return outcome

    async def broadcast(self, value: Any, what: str = "broadcast") -> Any:
        """Every rank returns rank 0's ``value`` (JSON; other ranks pass anything), sent
        within the save in flight: what a layer commits along with it after the outcome
        (the tier manifest), as :meth:`DistCoordinator.broadcast` sends it on the trainers'
        group."""
        run = self._run
        if run is None:
            raise self._fail(what, "no save of this worker is in flight")
        if self.rank != 0:
            msg = await self._until(what, self._reply(run, "value"), lambda: f"rank 0's {what}")
            return msg.get("value")
        conns = list(run.via.values())
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.post({"op": "value", "save": run.token, "value": value})
        await asyncio.gather(*(c.flush(self.timeout_s) for c in conns), return_exceptions=True)
        return value


def save_scope(coordinator: Coordinator, step: int) -> AbstractAsyncContextManager[None]:
    """What a worker runs one save in: :meth:`PeerCoordinator.save` for a group of workers
    (also when a layer wraps it, keeping it as ``inner``: the tier commit), nothing for any
    other coordinator."""
    inner = getattr(coordinator, "inner", coordinator)
    if isinstance(inner, PeerCoordinator):
        return inner.save(step)
    return contextlib.nullcontext()
