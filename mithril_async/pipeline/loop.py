"""A private asyncio event loop on a daemon thread, so synchronous training loops get
background checkpointing without running asyncio themselves.

uvloop is used when it is installed. Coroutines are submitted with :meth:`BackgroundLoop.submit`
(returns a ``concurrent.futures.Future``) or run to completion with :meth:`BackgroundLoop.run`.

The loop thread can run at a lower CPU priority (``nice``): on Linux a thread's nice value is
its own and is inherited by the threads it starts, so the executors' workers that the loop
spawns (file writes, codec work submitted from it) run at the same priority. Training threads
then keep the cores when both want them; idle cores still go to the checkpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("mithril_async")


def lower_priority(nice: int) -> bool:
    """Run the calling thread at the process's main-thread nice value + ``nice`` (capped at
    19); whether it took. Idempotent, so a worker that inherited the value from a thread that
    called this already is not lowered twice.

    Only lowers priority, which needs no privilege. Where per-thread priorities do not exist
    (not Linux) the thread is left as it is and the reason is logged at debug level.
    """
    if nice <= 0:
        return False
    try:
        tid = threading.get_native_id()
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except (AttributeError, OSError) as err:  # pragma: no cover - Linux has both
        log.debug("could not lower the priority of thread %s: %r",
                  threading.current_thread().name, err)
        return False
    return True


async def all_or_first_error(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` concurrently; return their results in order, or raise the first error.

    Unlike ``asyncio.gather`` the others are cancelled *and awaited* before the error is
    raised (a write still running could otherwise land after the save was discarded), and
    unlike a ``TaskGroup`` the error comes out as itself, not wrapped in an ExceptionGroup (so
    a failed save still raises the typed error of the store or codec that failed).
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled()
                       and t.exception() is not None), None)
        if failed is None:
            return [t.result() for t in tasks]
        err = failed.exception()
    finally:  # an error, or we were cancelled ourselves: take the others down first
        for t in tasks:
            t.cancel()  # a no-op on finished tasks
        await asyncio.gather(*tasks, return_exceptions=True)
    assert err is not None
    raise err


def run_to_completion(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code: on this thread, or on a thread of
    its own when this one already runs an event loop (a notebook, an async caller)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def new_event_loop() -> tuple[asyncio.AbstractEventLoop, str]:
    """Create an event loop, preferring uvloop; return it with the name of its kind."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency on Linux
        return asyncio.new_event_loop(), "asyncio"
    return uvloop.new_event_loop(), "uvloop"


class BackgroundLoop:
    """An event loop running forever on its own daemon thread until :meth:`close`."""

    def __init__(self, name: str = "mithril-loop", nice: int = 0) -> None:
        self.loop, self.kind = new_event_loop()
        self.nice = nice
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        #: futures of submitted coroutines still running (cancelled by :meth:`close`)
        self._submitted: set[concurrent.futures.Future[Any]] = set()
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        lower_priority(self.nice)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the background loop; thread-safe."""
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("background loop is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._submitted.add(fut)
        fut.add_done_callback(self._submitted.discard)
        return fut

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the background loop and block until it finishes."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundLoop.run called from its own thread would deadlock")
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Stop the loop and join the thread; pending tasks are cancelled first."""
        if self.loop.is_closed():
            return

        async def _cancel_all() -> None:
            # Cancel what callers submitted (a save, a restore), not every task: the tasks
            # those spawn - shielded cleanups that abort uploads and remove an unfinished
            # version, waits for a worker thread to settle - must finish, within a bound.
            for fut in list(self._submitted):
                fut.cancel()
            me = asyncio.current_task()
            await asyncio.sleep(0)  # let the cancellations reach their tasks
            pending = {t for t in asyncio.all_tasks() if t is not me}
            if pending:
                _, pending = await asyncio.wait(pending, timeout=10)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(25)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
