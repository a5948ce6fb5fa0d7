"""Who hears of each save's result, and on which thread: :class:`ResultListeners`.

Every :class:`~mithril_async.save.results.SaveResult` a manager produces (committed,
failed, or skipped because the pipeline was busy) is handed to the manager's listeners
(``CheckpointManager(on_result=...)``, ``manager.add_listener(fn)``) on a dispatcher thread of
their own, in the order the saves ended: the training thread only appends to a queue, so a
slow listener (a metrics upload, a logger flushing to the network) never stalls a step, and
the background loop never waits for user code either. A listener that raises is logged at
ERROR with its traceback and the step; the save, the other listeners and later results are
not affected. A save that failed is logged at ERROR naming its step, whoever listens.

``manager.wait()`` and ``close()`` return only once every result of a finished save has been
delivered (``flush``), so after them nothing is still on its way.

``on_save`` is different: it runs on the background
loop *before* the save's handle resolves, for committed saves only, so code that must see or
annotate the result before ``handle.result()`` returns can (``TierLayer`` fills ``res.tiers``
there). Its exceptions are logged and never fail a committed save. For logging and metrics,
use ``on_result``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Awaitable, Callable

from mithril_async.save.results import SaveResult

__all__ = ["Listener", "ResultListeners"]

log = logging.getLogger("mithril_async")

#: a listener: called once per result, on the dispatcher thread
Listener = Callable[[SaveResult], object]


class ResultListeners:
    """The listeners of one manager, their dispatcher thread, and the inline ``on_save`` hook.

    ``last`` listeners run after every user listener of the same result (the signal saves
    of :mod:`~mithril_async.preemption` end the process there: a result reaches every user
    listener first)."""

    def __init__(self, on_result: Listener | None = None,
                 on_save: Callable[[SaveResult], None] | None = None) -> None:
        self._listeners: list[Listener] = [] if on_result is None else [on_result]
        self._last: list[Listener] = []
        self._on_save = on_save
        self._queue: queue.Queue[SaveResult | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---------------------------------------------------------------- who listens
    def add(self, fn: Listener, *, last: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"a listener must be callable, got {type(fn).__name__}")
        with self._lock:
            (self._last if last else self._listeners).append(fn)

    def remove(self, fn: Listener) -> None:
        """Stop calling ``fn`` (results already being delivered may still reach it)."""
        with self._lock:
            for group in (self._listeners, self._last):
                if fn in group:
                    group.remove(fn)
                    return
        raise ValueError(f"{fn!r} is not a listener of this manager")

    # ---------------------------------------------------------------- what they hear
    def inline(self, res: SaveResult) -> None:
        """The ``on_save`` hook (``SaveContext.on_save``): a committed result, on the background
        loop, before the save's handle resolves; an exception is logged, the save stands."""
        if self._on_save is None:
            return
        try:
            self._on_save(res)
        except Exception:
            log.exception("on_save callback failed on the result of step %d (the save is "
                          "committed all the same)", res.step)

    async def follow(self, run: Awaitable[SaveResult], res: SaveResult) -> SaveResult:
        """Run a save's background part; publish its result (committed or failed) before the
        save's future resolves, so a ``wait()`` that saw it finish also finds it queued."""
        try:
            out = await run
        except BaseException as err:
            self.failed(res, err)
            raise
        self.publish(out)
        return out

    def failed(self, res: SaveResult, err: BaseException) -> None:
        """A save ended in ``err``: mark its result failed (logged at ERROR with the step,
        unless the pipeline did already) and publish it."""
        if isinstance(err, asyncio.CancelledError):
            if res.status != "failed":
                res.status, res.error = "failed", "cancelled before it committed"
                log.warning("save of step %d was cancelled before it committed", res.step)
        elif res.status != "failed":  # the pipeline's own failure path logs what it marks
            res.status, res.error = "failed", f"{type(err).__name__}: {err}"
            log.error("save of step %d (%s) failed: %s", res.step, res.version_id or "-",
                      res.error)
        self.publish(res)

    def publish(self, res: SaveResult) -> None:
        """Hand ``res`` to the dispatcher (a queue append; nothing when nobody listens)."""
        with self._lock:
            if not (self._listeners or self._last):
                return
            if self._closed:
                log.warning("result of step %d (%s) came after the manager closed; its "
                            "listeners are not called", res.step, res.status)
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, daemon=True,
                                                name="mithril-results")
                self._thread.start()
        self._queue.put(res)

    # ---------------------------------------------------------------- the dispatcher thread
    def _dispatch(self) -> None:
        while True:
            res = self._queue.get()
            try:
                if res is None:
                    return
                with self._lock:
                    fns = [*self._listeners, *self._last]
                for fn in fns:
                    try:
                        fn(res)
                    except BaseException:  # a listener never stops the others, nor later results
                        log.exception("save result listener %r failed on the result of step "
                                      "%d (%s)", fn, res.step, res.status)
            finally:
                self._queue.task_done()

    @property
    def thread(self) -> threading.Thread | None:
        """The dispatcher thread, once a result was published to a listener."""
        return self._thread

    def flush(self) -> None:
        """Block until every published result was delivered (not on the dispatcher thread:
        a listener waiting for itself would never return)."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._queue.join()

    def close(self) -> None:
        """Deliver what is queued, then stop the dispatcher thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        if threading.current_thread() is not thread:
            thread.join()
