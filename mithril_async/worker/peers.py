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
import logging
import secrets
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from pydantic import ValidationError

from mithril_async.errors import DistributedError
from mithril_async.manifest import PieceLayout, gc_paused
from mithril_async.save.coordinator import (
    Coordinator,
    Outcome,
    RankPart,
    compact_part,
    innermost,
    layout_senders,
    with_layouts,
)
from mithril_async.worker.peer_group import Broken, PeerGroup, SaveRun
from mithril_async.worker.peer_links import rendezvous

__all__ = ["PeerCoordinator", "rendezvous", "save_scope"]


log = logging.getLogger("mithril_async")

class PeerCoordinator(PeerGroup):
    """The rank protocol's collectives among the job's checkpoint workers (module doc).

    ``address``: what :func:`rendezvous` gave (host, port, secret, timeout_s); ``listener``:
    rank 0's listening socket. :meth:`start` on the worker's event loop first; one save at a
    time, each inside :meth:`save`."""

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
                raise Broken(f"rank 0's checkpoint worker went away ({conn.lost})")
            return None

        msg = await self._until(what, agreed, lambda: "rank 0's version number")
        run = self._run = SaveRun(str(msg.get("save")), step, via={0: conn})
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
        run = SaveRun(secrets.token_hex(8), self._step)

        def connected() -> bool | None:
            left = [r for r in others if r in self._left]
            if left:
                raise Broken(f"rank {left[0]}'s checkpoint worker exited "
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
                    raise Broken(run.failed)
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

    def _reply(self, run: SaveRun, op: str) -> Callable[[], dict[str, Any] | None]:
        """Another rank: rank 0's ``op`` message of ``run`` (or its abort)."""
        conn = run.via[0]

        def check() -> dict[str, Any] | None:
            for i, msg in enumerate(self._inbox):
                if msg.get("save") == run.token and msg["op"] in (op, "abort"):
                    del self._inbox[i]
                    if msg["op"] == "abort":
                        run.done = True
                        raise Broken(f"the save failed on {msg.get('error')}")
                    return msg
            if conn.lost is not None:
                raise Broken(f"rank 0's checkpoint worker went away ({conn.lost})")
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
    inner = innermost(coordinator)
    if isinstance(inner, PeerCoordinator):
        return inner.save(step)
    return contextlib.nullcontext()
