"""Reading a blob in windows: how big, how many in flight, in order or not, and running
work on the codec pool so that none still runs when a restore reports.

A restore streams each blob in windows of a few MiB (:func:`window_plan`): small enough that
a window is still in the CPU cache when it is hashed or decoded, as many in flight as keep
the codec threads busy (or, over a network, the store's requests) within the in-flight
budget. :func:`settled` is how every write into the live state runs: a call on a pool thread
cannot be stopped once it runs, so nothing returns or raises while one still does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from mithril_async.codec.container import BlockRef
from mithril_async.errors import InvalidFormat
from mithril_async.pipeline.pool import CodecPool
from mithril_async.storage.base import Store
from mithril_async.storage.capabilities import RangeReading, read_concurrency

__all__ = ["REMOTE_WINDOW", "WINDOW", "checked_read", "group_windows", "ordered_reads",
           "pool_threads", "range_reads", "read_concurrency", "settled", "window_plan"]

#: bytes per ranged read of a streamed restore: small enough that a window read is still in
#: the CPU cache when it is hashed or decoded, big enough that a read's per-call cost vanishes
WINDOW = 4 << 20
#: bytes per ranged read from a remote store (S3): a request's latency is paid per read, and
#: servers serve larger ranges at full speed
REMOTE_WINDOW = 8 << 20


def pool_threads(pool: Executor) -> int:
    """How many threads decode on ``pool`` (1 for an executor other than a
    :class:`~mithril_async.pipeline.pool.CodecPool`)."""
    return pool.threads if isinstance(pool, CodecPool) else 1


def window_plan(budget: int, threads: int, remote: int = 0) -> tuple[int, int]:
    """``(window bytes, windows in flight)`` for a restore allowed ``budget`` bytes in
    flight: :data:`WINDOW`-sized reads, as many in flight as keep every codec thread busy
    (two per thread, at least 3) and fit the budget (at least 2). ``remote``: the store's
    request concurrency, for a store across a network
    (:func:`~mithril_async.storage.capabilities.read_concurrency`): reads of up to
    :data:`REMOTE_WINDOW` (half the budget at most, :data:`WINDOW` at least), as many in
    flight as the store runs requests at once and the budget allows (at least 2): there the
    reads' latency, not the codec threads, is what to hide."""
    if remote:
        window = max(WINDOW, min(REMOTE_WINDOW, budget // 2))
        return window, max(2, min(remote, budget // window))
    depth = max(2, min(max(3, 2 * threads), budget // WINDOW))
    return WINDOW, depth


def group_windows(blocks: list[BlockRef], window: int
                  ) -> list[tuple[tuple[int, int], list[BlockRef]]]:
    """Consecutive blocks (sorted by offset) grouped into reads ``(offset, length)`` of at
    most ``window`` bytes (a block larger than the window is read alone)."""
    out: list[tuple[tuple[int, int], list[BlockRef]]] = []
    for b in blocks:
        if out:
            (off, ln), group = out[-1]
            if off + ln == b.offset and ln + b.length <= window:
                out[-1] = ((off, ln + b.length), [*group, b])
                continue
        out.append(((b.offset, b.length), [b]))
    return out


def checked_read(key: str, span: tuple[int, int], data: bytes) -> memoryview:
    """The bytes of a ranged read of ``span`` (offset, length), as a memoryview, or
    :class:`InvalidFormat` when the read returned another length (the blob shrank)."""
    if len(data) != span[1]:
        raise InvalidFormat(f"{key}: ranged read of {span[1]} bytes at {span[0]} "
                            f"returned {len(data)}")
    return memoryview(data).cast("B")


@contextlib.asynccontextmanager
async def range_reads(store: Store, key: str, pool: Executor
                      ) -> AsyncIterator[Callable[[int, int], Awaitable[bytes]]]:
    """``read(offset, length)`` of blob ``key``: on ``pool`` through one open file where the
    store offers it (:class:`~mithril_async.storage.capabilities.RangeReading`), else the
    store's ``get_range``."""
    reader = await store.open_range_reader(key) if isinstance(store, RangeReading) else None
    if reader is None:
        yield lambda off, ln: store.get_range(key, off, ln)
        return
    loop = asyncio.get_running_loop()
    try:
        yield lambda off, ln: loop.run_in_executor(pool, reader.read, off, ln)
    finally:  # a read still running closes the file when it ends
        reader.close()


async def ordered_reads(spans: list[tuple[int, int]],
                        read: Callable[[int, int], Awaitable[bytes]], depth: int,
                        process: Callable[[int, bytes], Awaitable[None]], where: str) -> None:
    """Read ``spans`` with up to ``depth`` reads in flight and ``await process(off, data)``
    for each, in order (a streamed hash needs the bytes in order)."""
    pending: collections.deque[tuple[int, int, asyncio.Future[bytes]]] = collections.deque()
    it = iter(spans)

    def more() -> None:
        nxt = next(it, None)
        if nxt is not None:
            pending.append((*nxt, asyncio.ensure_future(read(*nxt))))

    try:
        for _ in range(depth):
            more()
        while pending:
            off, ln, fut = pending.popleft()
            data = await fut
            more()
            if len(data) != ln:
                raise InvalidFormat(f"{where}: ranged read of {ln} bytes at {off} returned "
                                    f"{len(data)}")
            await process(off, data)
    finally:
        for _, _, fut in pending:
            fut.cancel()


async def settled(pool: Executor, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]
                  ) -> None:
    """Run ``calls`` on ``pool``; return (or raise the first one's error) only once none is
    running, even when cancelled meanwhile (a call not started yet is then dropped): a call
    writing into the live tensors cannot be stopped once it runs, and a restore must not
    report, nor a fallback begin writing an older version, while one still writes."""
    if not calls:
        return
    futs = [pool.submit(fn, *args) for fn, args in calls]
    waits = [asyncio.wrap_future(f) for f in futs]
    try:
        await asyncio.wait(waits)
    except asyncio.CancelledError:
        for f in futs:
            f.cancel()  # those not started yet; a running one goes on
        running = [w for w in waits if not w.done()]
        if running:
            await asyncio.wait(running)
        for w in waits:  # retrieved: the cancellation is what is raised
            if w.done() and not w.cancelled():
                w.exception()
        raise
    errors = [w.exception() for w in waits]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
