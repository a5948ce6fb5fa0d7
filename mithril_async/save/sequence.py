"""The saves of one manager, one after the other: the caller's half of each save.

At most one save is in flight. :class:`SaveSequence` takes a save from the caller's
``save()`` / ``save_nowait()`` up to its handle (:meth:`SaveSequence.steps`, one generator
for both: what it waits for is yielded, :mod:`~mithril_async.save.waiting`): the step is
checked (a committed step is never overwritten), a busy pipeline is waited for, skipped or
refused (``on_busy``), the state is snapshotted (an overlapped snapshot defers what its
:class:`~mithril_async.save.overlap.StepGuard` covers) and the background half is started,
inline or handed to the checkpoint worker. A failed save's error is kept until reported once
(:meth:`SaveSequence.take_error`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

from mithril_async.errors import SaveFailed, SaveInProgress, StepAlreadyExists
from mithril_async.listeners import ResultListeners
from mithril_async.live import LiveState
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.save.context import SaveContext
from mithril_async.save.job import SaveJob
from mithril_async.save.overlap import StepGuard
from mithril_async.save.results import SaveHandle, SaveResult
from mithril_async.save.waiting import Consumed, DeviceCopied, Done, Result, Wait

if TYPE_CHECKING:
    from mithril_async.preemption import Preemption
    from mithril_async.worker.client import WorkerClient

log = logging.getLogger("mithril_async")


class SaveSequence:
    """The saves of one manager (module docstring). ``loop``: the manager's background loop,
    started (with its start-up maintenance) on first use; ``continued_run``: the manager
    continues the runs folder's current run (said when a step already exists)."""

    def __init__(self, ctx: SaveContext, live: LiveState, results: ResultListeners,
                 worker: WorkerClient | None, loop: Callable[[], BackgroundLoop], *,
                 continued_run: bool) -> None:
        self.ctx = ctx
        self.live = live
        self.results = results
        self.worker = worker
        self._loop = loop
        self.continued_run = continued_run
        #: save_on_signals: told of each save (set by the manager once it has one)
        self.preemption: Preemption | None = None
        #: the last save's handle (its future: the save in flight), until its outcome has
        #: been taken; ``error_seen`` says whether its caller already saw its error
        self.handle: SaveHandle | None = None
        self._error: BaseException | None = None
        #: snapshot = "overlapped": hooks on the state's optimizers, made at the first save
        self.guard: StepGuard | None = None

    @property
    def inflight(self) -> concurrent.futures.Future[SaveResult] | None:
        """The last save's future (done or not) until its outcome has been taken."""
        return None if self.handle is None else self.handle.future

    def busy_with(self) -> concurrent.futures.Future[Any] | None:
        """What a new save waits for (or is skipped / refused for, ``on_busy``): the save in
        flight, or a save cancelled here that the worker has not answered for yet (it may
        still read the staging buffers the new snapshot would be taken into)."""
        fut = self.inflight
        if fut is not None and not fut.done():
            return fut
        if self.worker is not None and not self.worker.released.done():
            return self.worker.released
        return None

    def check_for_errors(self) -> None:
        """Raise the error of a failed save (once), as :class:`SaveFailed`; a save the
        caller cancelled is not an error."""
        err = self.take_error()
        if err is not None:
            raise SaveFailed(f"a background save failed: {err}") from err

    def take_error(self) -> BaseException | None:
        """The error of a failed save not yet reported (then forgotten: reported once)."""
        fut = self.inflight
        if fut is not None and fut.done():
            self.handle = None
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None:
                self._error = exc
        err, self._error = self._error, None
        return err

    async def finished(self) -> None:
        """Wait for the save in flight (and the worker's answer for one cancelled here) and
        its listeners; raise :class:`SaveFailed` if it failed."""
        fut = self.inflight
        if fut is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(fut)
        if self.worker is not None:
            await asyncio.shield(asyncio.wrap_future(self.worker.released))
        await asyncio.get_running_loop().run_in_executor(None, self.results.flush)
        self.check_for_errors()

    def finished_sync(self) -> None:
        """:meth:`finished`, blocking the calling thread."""
        fut = self.inflight
        if fut is not None:
            concurrent.futures.wait([fut])
        if self.worker is not None:
            concurrent.futures.wait([self.worker.released])
        self.results.flush()
        self.check_for_errors()

    def steps(self, step: int, metrics: Mapping[str, Any] | None, t0: float
              ) -> Generator[Wait, None, SaveHandle]:
        """A save on the caller's thread, up to its handle: what it waits for is yielded
        (awaited by ``save()``, blocked on by ``save_nowait()``)."""
        self._begin(step)
        waited = 0.0
        if self.busy_with() is not None:
            if self.ctx.config.checkpointing.pipeline.on_busy != "wait":
                return self._busy(step, t0)
            log.info("save of step %d waits for the previous save (on_busy=wait)", step)
            while (fut := self.busy_with()) is not None:
                yield Done(fut, cancels=fut is self.inflight)
            waited = time.perf_counter() - t0
        self.check_for_errors()
        job = SaveJob(self.ctx, step, t0)
        for snap in job.snapshot(self._deferrable(), self.guard):
            yield DeviceCopied(snap)
        handle, handoff = self._submit(job, metrics, waited)
        yield Consumed(job)  # streamed (host_memory_mib): until its chunks are copied out
        if handoff is not None:
            yield Result(handoff)
        return handle

    def _begin(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._loop()
        self.check_for_errors()
        steps = self.ctx.steps
        if steps is not None and step in steps:
            why = (" (run_id is not set, so this job continues the runs folder's current run: "
                   "restore it to resume, or set new_run = true to start a new run)"
                   if self.continued_run else "")
            raise StepAlreadyExists(f"run {self.ctx.layout.run_id}: step {step} is already "
                                    f"committed; nothing is overwritten{why}")
        if self.preemption is not None:
            self.preemption.saving(step)

    def _busy(self, step: int, t0: float) -> SaveHandle:
        if self.ctx.config.checkpointing.pipeline.on_busy == "error":
            raise SaveInProgress(f"save of step {step} refused: a save is still in flight")
        res = SaveResult(step, status="skipped", stall_s=time.perf_counter() - t0)
        log.info("save of step %d skipped: previous save still in flight (on_busy=skip)", step)
        self.ctx.history.append(res)
        self.results.publish(res)
        return SaveHandle(res)

    def _deferrable(self) -> frozenset[int]:
        """Addresses of the tensors an overlapped snapshot may copy after ``save()`` returns
        (none with snapshot = "blocking"); waits for any copy still running first."""
        if self.ctx.config.checkpointing.pipeline.snapshot != "overlapped":
            return frozenset()
        if self.guard is None:
            self.guard = StepGuard(self.live.optimizers())
            if not self.guard.optimizers:
                log.warning('snapshot = "overlapped": no optimizer in the state, so nothing '
                            "is guarded and every tensor is copied before save() returns")
        self.guard.wait()
        return self.guard.pointers()

    def _submit(self, job: SaveJob, metrics: Mapping[str, Any] | None, waited: float
                ) -> tuple[SaveHandle, concurrent.futures.Future[None] | None]:
        """Start the save's background half; also return, in worker mode with the worker
        ready, a future done once the save is handed to the worker: ``save()`` returns
        after it, so a trainer killed from then on does not take the save with it. (A save
        made while the worker is still starting, right after the manager was made or after
        a worker died, does not wait for that start-up: it is handed over from the
        background once the worker is ready.)"""
        res = job.begin(metrics, waited)
        if self.preemption is not None:
            self.preemption.submitted(job.step)
        handoff = None
        if self.worker is not None:
            if self.worker.ready:
                handoff = self.worker.expect_handoff()
            self.worker.start()  # a worker that died is replaced
            run = self.worker.run(job, dict(metrics or {}))
        else:
            run = job.run()
        self.handle = SaveHandle(res, self._loop().submit(self.results.follow(run, res)))
        return self.handle, handoff
