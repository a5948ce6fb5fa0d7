"""The workers' rank protocol (worker/peers.py) over real TCP sockets, every rank's
coordinator on one event loop: a whole save, what a stranger's connection gets, a peer whose
connection breaks, a rank that never connects (bounded by the timeout)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from mithril_async.errors import DistributedError
from mithril_async.manifest import BlobRef
from mithril_async.save.coordinator import Outcome, RankPart
from mithril_async.worker.peer_links import HELLO_MAX
from mithril_async.worker.peers import PeerCoordinator


def _group(world: int, timeout_s: float = 60.0
           ) -> tuple[list[PeerCoordinator], dict[str, Any]]:
    listener = socket.create_server(("127.0.0.1", 0))
    address = {"host": "127.0.0.1", "port": listener.getsockname()[1],
               "secret": "s3cret", "timeout_s": timeout_s}
    coords = [PeerCoordinator(0, world, address, listener)]
    coords += [PeerCoordinator(r, world, address) for r in range(1, world)]
    return coords, address


async def _claim() -> int:
    return 7


def _part(rank: int) -> RankPart:
    return RankPart(rank=rank, model=BlobRef(key=f"m{rank}", bytes=1, xxh64="0" * 16))


async def _save(coord: PeerCoordinator, step: int, fail: str | None = None,
                before: Callable[[], Awaitable[None]] | None = None) -> Any:
    """One save's protocol on ``coord``; rank 0 commits iff no part failed."""
    async with coord.save(step):
        number = await coord.agree_version(_claim)
        if before is not None:
            await before()
        part = _part(coord.rank) if fail is None else RankPart(rank=coord.rank, error=fail)
        parts = await coord.gather_parts(part)
        outcome = None
        if parts is not None:
            bad = [p for p in parts if p.error]
            outcome = Outcome(committed=not bad, failed_rank=bad[0].rank if bad else None,
                              error=bad[0].error if bad else None)
        got = await coord.broadcast_outcome(outcome)
        return number, parts, got


async def _run_group(world: int, body: Callable[[list[PeerCoordinator]], Awaitable[Any]],
                     timeout_s: float = 60.0) -> Any:
    coords, _ = _group(world, timeout_s)
    try:
        for c in coords:
            await c.start()
        return await asyncio.wait_for(body(coords), 120)  # a hang guard only
    finally:
        for c in coords:
            await c._leave()


def test_a_save_agrees_gathers_and_broadcasts_among_three_workers() -> None:
    async def body(coords: list[PeerCoordinator]) -> Any:
        first = await asyncio.gather(*(_save(c, 1) for c in coords))
        second = await asyncio.gather(*(_save(c, 2, fail="disk full" if c.rank == 2 else None)
                                        for c in coords))
        return first, second

    first, second = asyncio.run(_run_group(3, body))
    assert [n for n, _, _ in first] == [7, 7, 7]
    parts = first[0][1]
    assert [p.rank for p in parts] == [0, 1, 2] and parts[2].model.key == "m2"
    assert all(o.committed for _, _, o in first) and first[1][1] is None
    assert all(not o.committed and o.failed_rank == 2 and o.error == "disk full"
               for _, _, o in second)


def test_a_stranger_is_refused_unread_and_the_group_still_saves() -> None:
    async def body(coords: list[PeerCoordinator]) -> Any:
        port = coords[0].port
        strangers = []
        for frame in (struct.pack("<Q", HELLO_MAX + 1),  # declares too much: never read
                      _frame(b'{"op":"hello","rank":1,"secret":"guess"}'),
                      _frame(b"not json")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(frame)
            await writer.drain()
            strangers.append(reader)
        closed = [await r.read() for r in strangers]  # each is closed by rank 0
        return closed, await asyncio.gather(*(_save(c, 1) for c in coords))

    closed, saved = asyncio.run(_run_group(2, body))
    assert closed == [b"", b"", b""]
    assert all(o.committed for _, _, o in saved)


def _frame(body: bytes) -> bytes:
    return struct.pack("<Q", len(body)) + body


def test_a_peer_whose_connection_breaks_fails_the_save_on_every_rank_at_once() -> None:
    async def body(coords: list[PeerCoordinator]) -> Any:
        async def cut() -> None:  # rank 1's worker "dies" after the agreement
            assert coords[1]._up is not None
            coords[1]._up.writer.transport.abort()

        got = await asyncio.gather(_save(coords[0], 1), _save(coords[1], 1, before=cut),
                                   _save(coords[2], 1), return_exceptions=True)
        # rank 1 connects again (a new worker) and the next save commits
        return got, await asyncio.gather(*(_save(c, 2) for c in coords))

    got, after = asyncio.run(_run_group(3, body))
    assert all(isinstance(e, DistributedError) for e in got), got
    assert "rank 1's checkpoint worker went away" in str(got[0])
    assert "went away" in str(got[1])
    assert "rank 0" in str(got[2]) and "rank 1" in str(got[2])
    assert all(o.committed for _, _, o in after)


def test_a_rank_that_never_connects_fails_the_save_within_the_timeout() -> None:
    async def body(coords: list[PeerCoordinator]) -> Any:
        return await asyncio.gather(_save(coords[0], 1), _save(coords[1], 1),
                                    return_exceptions=True)

    coords, _ = _group(3, timeout_s=0.5)

    async def run() -> Any:
        await coords[0].start()
        await coords[1].start()  # rank 2's worker never starts
        try:
            return await asyncio.wait_for(body(coords), 120)
        finally:
            await coords[0]._leave()
            await coords[1]._leave()

    got = asyncio.run(run())
    assert all(isinstance(e, DistributedError) for e in got), got
    assert "timed out" in str(got[0]) and "rank(s) 2" in str(got[0])
    assert "rank 0" in str(got[1])  # told by rank 0, not left to its own timeout


@pytest.mark.parametrize("rank", [0, 1])
def test_a_save_that_ends_before_its_protocol_tells_the_others(rank: int) -> None:
    async def body(coords: list[PeerCoordinator]) -> Any:
        async def boom() -> None:
            raise OSError("encoder crashed")

        return await asyncio.gather(
            *(_save(c, 1, before=boom if c.rank == rank else None) for c in coords),
            return_exceptions=True)

    got = asyncio.run(_run_group(2, body))
    assert isinstance(got[rank], OSError)
    other = got[1 - rank]
    assert isinstance(other, DistributedError) and "encoder crashed" in str(other), other
