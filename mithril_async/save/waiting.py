"""What a save waits for on the caller's thread, awaited by an async caller or blocked on by a
synchronous one.

The manager's save is one generator of :class:`Wait` steps, run by ``save()`` (awaiting each,
:func:`run_awaiting`) and by ``save_nowait()`` (blocking on each, :func:`run_blocking`): both
entry points take the same steps in the same order, and differ only in how they wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__ = ["Consumed", "DeviceCopied", "Done", "Result", "Wait", "run_awaiting",
           "run_blocking"]

T = TypeVar("T")


class Wait(Protocol):
    """One wait of a save on the caller's thread."""

    def block(self) -> None: ...

    async def wait(self) -> None: ...


@dataclass
class Done:
    """Until ``future`` is done (the save in flight, or the worker's release of one).

    Blocking, its outcome is not raised here. Awaiting, with ``cancels`` (the save in
    flight) a cancelled waiter cancels it too, the documented way to give up on a save that
    takes too long (a timeout around ``await manager.save(...)``), and its error is raised;
    without, it is shielded from the waiter's cancellation."""

    future: concurrent.futures.Future[Any]
    cancels: bool = False

    def block(self) -> None:
        concurrent.futures.wait([self.future])

    async def wait(self) -> None:
        if self.cancels:
            await asyncio.wrap_future(self.future)
        else:
            await asyncio.shield(asyncio.wrap_future(self.future))


@dataclass
class Result:
    """Until ``future`` is done, raising its error (a save's hand-over to its worker)."""

    future: concurrent.futures.Future[Any]

    def block(self) -> None:
        self.future.result()

    async def wait(self) -> None:
        await asyncio.wrap_future(self.future)


@dataclass
class DeviceCopied:
    """Until a snapshot's device copies completed (a :class:`~mithril_async.save.buffers.
    HostCopies`)."""

    snapshot: Any

    def block(self) -> None:
        self.snapshot.wait_blocking()

    async def wait(self) -> None:
        await self.snapshot.wait()


@dataclass
class Consumed:
    """Until a streamed save's chunks the caller must not change are copied out (a
    :class:`~mithril_async.save.job.SaveJob`; at once when it is staged)."""

    job: Any

    def block(self) -> None:
        self.job.wait_consumed()

    async def wait(self) -> None:
        await self.job.consumed()


def run_blocking(steps: Generator[Wait, None, T]) -> T:
    """Run ``steps``, blocking on each wait; its return value."""
    try:
        wait = next(steps)
        while True:
            wait.block()
            wait = steps.send(None)
    except StopIteration as done:
        return done.value


async def run_awaiting(steps: Generator[Wait, None, T]) -> T:
    """Run ``steps``, awaiting each wait; its return value."""
    try:
        wait = next(steps)
        while True:
            await wait.wait()
            wait = steps.send(None)
    except StopIteration as done:
        return done.value
