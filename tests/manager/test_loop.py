"""all_or_first_error: results in order, or the first error as itself after the others stop."""

from __future__ import annotations

import asyncio

import pytest

from mithril_async.errors import StorageError
from mithril_async.pipeline.loop import BackgroundLoop, all_or_first_error


def test_results_in_order() -> None:
    async def val(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    async def main() -> list[int]:
        return await all_or_first_error([val(1, 0.03), val(2, 0.0), val(3, 0.01)])

    assert asyncio.run(main()) == [1, 2, 3]
    assert asyncio.run(all_or_first_error([])) == []


def test_first_error_raised_unwrapped_after_the_others_are_cancelled_and_awaited() -> None:
    events: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # cleanup that must finish before the error is raised
            events.append("slow cleaned up")
            raise

    async def fail() -> None:
        await asyncio.sleep(0.01)
        raise StorageError("disk full on blob x")

    async def main() -> None:
        await all_or_first_error([slow(), fail()])

    with pytest.raises(StorageError, match="disk full"):  # not an ExceptionGroup
        asyncio.run(main())
    assert events == ["slow cleaned up"]


def test_cancelling_the_caller_cancels_the_children() -> None:
    cancelled: list[int] = []

    async def child(i: int) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def main() -> None:
        task = asyncio.ensure_future(all_or_first_error([child(0), child(1)]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop = BackgroundLoop()
    try:
        loop.submit(main()).result(timeout=5)
    finally:
        loop.close()
    assert sorted(cancelled) == [0, 1]
