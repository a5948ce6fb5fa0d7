"""Overlapped snapshots (``[checkpointing.pipeline] snapshot = "overlapped"``).

A training step changes the weights and the optimizer state in one place only:
``optimizer.step()``. Between a save and that call come the next batch's forward and backward
passes, which read the weights but do not write them. So the copy of those tensors need not
block the loop: ``save()`` copies everything else (buffers such as batch-norm statistics, which
forward *does* change, step counters of other objects, RNG), hands the optimizer-owned tensors
to a background thread (the native copy releases the GIL) and returns; a pre-hook on each
optimizer's ``step()`` waits for that copy. The loop is then blocked only by whatever of the copy
is not hidden behind forward/backward (CheckFreq, FAST '21, pipelines its snapshot the same way).

Safety does not rest on the hook alone: every deferred source's version counter
(``Tensor._version``, bumped by every in-place op, shared by ``detach()`` views) is read at
``save()`` and again after the copy. If anything changed one in between (a manual ``p.add_()``,
``load_state_dict``, an optimizer we did not hook), the save fails with
:class:`~mithril_async.errors.SnapshotTorn` naming the tensors instead of writing a torn
checkpoint; the last committed version is untouched. (A write through ``.data`` bypasses the
counter; torch's optimizers do not do that.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mithril_async.device import await_event, order_after
from mithril_async.save.results import SaveResult
from mithril_async.save.staging import Job, copy_jobs, default_copy_threads, torn, torn_error
from mithril_async.save.stream_snapshot import StreamSnapshot
from mithril_async.sharded import to_local

_copier: concurrent.futures.ThreadPoolExecutor | None = None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that runs overlapped copies (``copy_jobs`` may add its own helper)."""
    global _copier
    if _copier is None:
        _copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mithril-overlap")
    return _copier


class OverlapCopy:
    """The deferred copies of one save, and what tells whether they are complete and untorn.

    CPU: byte copies run on a background thread, then the sources' version counters are
    compared. CUDA: the copies were queued on the staging area's side stream; ``events_now`` follow
    the copies of everything else (the current stream is ordered after them at once: later
    kernels such as a forward that updates batch-norm statistics run after those copies),
    ``events_later`` the optimizer-owned ones (the current stream is ordered after them in
    :meth:`before_step`). Their version counters are compared once, at the first of
    :meth:`before_step`, :meth:`wait_blocking` and the pipeline seeing the events complete:
    an in-place change queued before then may have raced the side stream.
    """

    def __init__(self, jobs: list[Job], watch: list[tuple[str, torch.Tensor, int]],
                 threads: int, *, events_now: list[Any] | None = None,
                 events_later: list[Any] | None = None,
                 device_watch: list[tuple[str, torch.Tensor, int]] | None = None) -> None:
        self.jobs, self.watch, self.threads = jobs, watch, threads
        self.events_now = list(events_now or [])
        self.events_later = list(events_later or [])
        self.device_watch = list(device_watch or [])
        self.result: SaveResult | None = None  # gets the step() waits, once submitted
        self._lock = threading.Lock()
        self._device_torn: list[str] | None = None  # None: not checked yet
        for ev in self.events_now:
            order_after(ev)
        if jobs:
            self.future: concurrent.futures.Future[None] = _executor().submit(self._run)
        else:
            self.future = concurrent.futures.Future()
            self.future.set_result(None)

    def _run(self) -> None:
        copy_jobs(self.jobs, self.threads)
        changed = torn(self.watch)
        if changed:
            raise torn_error(changed)

    def _check_device(self) -> list[str]:
        with self._lock:
            if self._device_torn is None:
                self._device_torn = torn(self.device_watch)
            return self._device_torn

    def _wait_cpu(self) -> float:
        if self.future.done():
            return 0.0
        t0 = time.perf_counter()
        concurrent.futures.wait([self.future])
        waited = time.perf_counter() - t0
        if self.result is not None:
            self.result.step_wait_s += waited
        return waited

    def before_step(self) -> float:
        """Before ``optimizer.step()``: wait for the CPU copy (its error is the save's to
        report); order the step's stream after the device copies. Seconds waited."""
        waited = self._wait_cpu()
        if self.events_later:
            self._check_device()
            for ev in self.events_later:
                order_after(ev)
        return waited

    def wait_blocking(self) -> float:
        """Block until every copy has finished (restore, next snapshot, close); seconds."""
        waited = self._wait_cpu()
        if self.events_now or self.events_later:
            self._check_device()
            for ev in self.events_now + self.events_later:
                ev.synchronize()
        return waited

    async def finished(self, poll_s: float = 0.0002) -> None:
        """Await every copy from the pipeline; raises :class:`SnapshotTorn` if one is torn."""
        await asyncio.wrap_future(self.future)
        for ev in self.events_now + self.events_later:
            await await_event(ev, poll_s)
        changed = self._check_device()
        if changed:
            raise torn_error(changed)


class StreamCopy:
    """An overlapped snapshot under ``host_memory_mib``: the optimizer-owned tensors are
    copied out by the encoder through the slot ring while forward/backward run (see
    :class:`~mithril_async.save.stream_snapshot.StreamSnapshot`). The step pre-hook waits only
    for what has not been copied out yet; the version check runs before that wait ends."""

    def __init__(self, stream: StreamSnapshot) -> None:
        self.stream = stream
        self.result: SaveResult | None = None

    def _wait(self) -> float:
        if self.stream.all_done.done():
            return 0.0
        t0 = time.perf_counter()
        concurrent.futures.wait([self.stream.all_done])
        waited = time.perf_counter() - t0
        if self.result is not None:
            self.result.step_wait_s += waited
        return waited

    def before_step(self) -> float:
        """Before ``optimizer.step()``: wait until the optimizer's tensors are copied out
        (their device copies have completed too: each slot's event is waited on)."""
        return self._wait()

    def wait_blocking(self) -> float:
        return self._wait()


def _owned_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in opt.param_groups:
        yield from group["params"]
    for per_param in opt.state.values():
        yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))


class StepGuard:
    """Pre-hooks on optimizers' ``step()`` that wait for the pending overlapped copy."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.pending: OverlapCopy | StreamCopy | None = None
        self.copy_threads = default_copy_threads()
        self._handles = [opt.register_step_pre_hook(self._before_step)
                         for opt in self.optimizers]

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        pending, self.pending = self.pending, None  # once ordered, later steps follow it
        if pending is not None:
            pending.before_step()

    def pointers(self) -> frozenset[int]:
        """Addresses of every tensor only ``step()`` changes (parameters, their state), CPU
        and CUDA alike (a device address never equals a host one)."""
        ptrs = set()
        for opt in self.optimizers:
            for t in _owned_tensors(opt):
                local = to_local(t)  # a DTensor's shard, else t itself
                if local.numel():
                    ptrs.add(local.data_ptr())
        return frozenset(ptrs)

    def wait(self) -> None:
        """Block until the pending copy has finished (before a restore, the next snapshot,
        close: they touch the live tensors or the staging buffers from the CPU)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait_blocking()

    def remove(self) -> None:
        self.wait()
        for h in self._handles:
            h.remove()
        self._handles.clear()
