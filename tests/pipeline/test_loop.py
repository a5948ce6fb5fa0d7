"""all_or_first_error: results in order, or the first error as itself after the others stop.

Every ordering here comes from events the coroutines wait on, never from sleep lengths, so a
loaded machine cannot reorder them."""

from __future__ import annotations

import asyncio

import pytest

from mithril_async.errors import StorageError
from mithril_async.pipeline.loop import BackgroundLoop, all_or_first_error


def test_results_in_order() -> None:
    finished: list[int] = []

    async def main() -> list[int]:
        after: dict[int, asyncio.Event] = {i: asyncio.Event() for i in (1, 2, 3)}

        async def val(x: int, waits_for: int | None) -> int:
            if waits_for is not None:
                await after[waits_for].wait()
            finished.append(x)
            after[x].set()
            return x

        # they finish 2, 3, 1: the results still come back in the order of the coroutines
        return await all_or_first_error([val(1, 3), val(2, None), val(3, 2)])

    assert asyncio.run(main()) == [1, 2, 3]
    assert finished == [2, 3, 1]
    assert asyncio.run(all_or_first_error([])) == []


def test_first_error_raised_unwrapped_after_the_others_are_cancelled_and_awaited() -> None:
    events: list[str] = []

    async def main() -> None:
        started = asyncio.Event()

        async def slow() -> None:
            try:
                started.set()
                await asyncio.Event().wait()  # never set: only the cancel ends it
            except asyncio.CancelledError:
                for _ in range(3):  # cleanup that takes several loop turns and must finish
                    await asyncio.sleep(0)  # before the error is raised
                events.append("slow cleaned up")
                raise

        async def fail() -> None:
            await started.wait()
            raise StorageError("disk full on blob x")

        try:
            await all_or_first_error([slow(), fail()])
        except StorageError:
            events.append("error raised")
            raise

    with pytest.raises(StorageError, match="disk full"):  # not an ExceptionGroup
        asyncio.run(main())
    assert events == ["slow cleaned up", "error raised"]


def test_cancelling_the_caller_cancels_the_children() -> None:
    cancelled: list[int] = []

    async def main() -> None:
        running: list[int] = []
        both = asyncio.Event()

        async def child(i: int) -> None:
            try:
                running.append(i)
                if len(running) == 2:
                    both.set()
                await asyncio.Event().wait()  # never set: only the cancel ends it
            except asyncio.CancelledError:
                cancelled.append(i)
                raise

        task = asyncio.ensure_future(all_or_first_error([child(0), child(1)]))
        await both.wait()  # both children really started before the cancel
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop = BackgroundLoop()
    try:
        loop.submit(main()).result(timeout=60)
    finally:
        loop.close()
    assert sorted(cancelled) == [0, 1]
