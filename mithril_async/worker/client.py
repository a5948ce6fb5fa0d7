"""The training process's side of a checkpoint worker: start it, hand it each snapshot, get
each save's result back.

The worker is ``python -m mithril_async.worker`` started with ``subprocess`` (never a fork,
never a re-import of the training script, so a script without an ``if __name__ ==
"__main__"`` guard works), holding one end of a socket pair. The manager starts it when it
is made; its start-up runs in the background while training goes on (a save made before it
is ready is handed over from the background once it is). A save's hand-off is the
snapshot's place in shared memory (:mod:`~mithril_async.worker.shm`) plus small JSON; the
worker's answer fills the save's :class:`~mithril_async.save.results.SaveResult`, and the
trainer follows it (base buffer sets, committed steps after retention) whatever became of the
save. A save cancelled here after its hand-off is cancelled in the worker too, and its staging
buffers stay the worker's until it answers (:attr:`WorkerClient.released`). On
several ranks the workers run the rank protocol among themselves
(:mod:`~mithril_async.worker.peers`): the trainers only agree once, when the manager is made,
on where rank 0's workers listen.

It is started with the job's signals blocked (it installs its own handling: they do not end
it, see :mod:`~mithril_async.worker.server`), its output to ``/dev/null`` (its last words,
a save's error after the trainer died, go to the trainer's stderr). A child forked by the
training process closes its inherited end of the channel at once, so it never keeps a
worker alive.

If the worker dies, the save in flight fails with :class:`~mithril_async.errors.WorkerExited`
naming how it ended (raised, as any failed save, by the next ``save()`` / ``wait()`` /
``close()``), training goes on, and the next save starts a new worker (segments are sent to
it again). ``close()`` asks the worker to exit and waits for it; a worker not yet set up, or
let go while a save runs (:meth:`WorkerClient.abandon`), is not waited for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

from mithril_async.errors import WorkerExited
from mithril_async.memory.ring import SlotLease
from mithril_async.save.context import SaveContext
from mithril_async.save.job import SaveJob
from mithril_async.save.results import SaveResult
from mithril_async.save.stream_snapshot import StreamSnapshot
from mithril_async.tiers.commit import VersionMeta
from mithril_async.worker.arena import SharedArena
from mithril_async.worker.channel import MAX_FDS, Channel, ChannelClosed
from mithril_async.worker.handoff import (
    config_doc,
    error_doc,
    error_of,
    pieces_doc,
    tensor_doc,
    update_result,
)
from mithril_async.worker.peers import rendezvous
from mithril_async.worker.signals import JOB_SIGNALS

__all__ = ["NodeTiers", "WorkerClient"]

log = logging.getLogger("mithril_async")
_channel_ids = itertools.count(1)
#: seconds ``close()`` waits for a worker to exit after asking it to
EXIT_WAIT_S = 60.0
#: every client of this process (a forked child closes their channels)
_clients: weakref.WeakSet[WorkerClient] = weakref.WeakSet()


def _forget_workers_after_fork() -> None:
    """In a child forked by the training process: drop the parent's workers (close the
    inherited socket ends without shutting the connection down, never signal or wait for
    the parent's worker), so a long-lived child never keeps a worker alive."""
    for client in list(_clients):
        client._forget()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


class WorkerClient:
    """One trainer's checkpoint worker (see the module docstring)."""

    def __init__(self, ctx: SaveContext, arena: SharedArena, *, run_id: str,
                 runs_prefix: str, sharded_model: bool, keep_all: bool = False,
                 tiers: NodeTiers | None = None) -> None:
        self.ctx = ctx
        self.arena = arena
        self.tiers = tiers
        self._init = {"config": config_doc(ctx.config), "run_id": run_id,
                      "runs_prefix": runs_prefix, "rank": ctx.rank,
                      "world_size": ctx.world_size, "sharded_model": sharded_model,
                      "keep_all": keep_all, "items": list(ctx.state)}
        if tiers is not None:  # the worker saves into the node folder
            self._init["tiers"] = {"root": str(tiers.root), "lead": tiers.lead}
        #: several ranks: where rank 0's workers listen (agreed by every rank now, a
        #: collective) and, on rank 0, the listening socket each of its workers is handed
        self._listener: socket.socket | None = None
        if ctx.world_size > 1:
            self._init["peers"], self._listener = rendezvous(ctx.coordinator)
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: Channel | None = None
        self._channel_id = 0
        self._ready: concurrent.futures.Future[Any] | None = None
        #: the chains were reset since the worker last heard (a restore)
        self._reset_pending = False
        #: done once the save in flight is written to the worker's socket (or failed before):
        #: from then on that save survives the trainer's death
        self._sent: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._sent.set_result(None)
        #: done once the worker has answered for the last save handed to it (see released)
        self._released: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._released.set_result(None)
        #: saves handed to run() and not yet answered
        self._running = 0
        #: the save being handed over, and its streamed snapshot (None: staged)
        self._streaming: tuple[int, StreamSnapshot | None] | None = None
        _clients.add(self)

    @property
    def ready(self) -> bool:
        """Whether a started worker has finished its set-up."""
        return self.alive and self._ready is not None and self._ready.done()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the started worker to finish
        its set-up; whether it has (False: none started, or it failed or died)."""
        ready = self._ready
        if ready is None:
            return False
        with contextlib.suppress(concurrent.futures.TimeoutError):
            ready.exception(timeout)
        return self.ready and ready.exception() is None

    def expect_handoff(self) -> concurrent.futures.Future[None]:
        """A future done once the next :meth:`run` has handed its save to the worker (or
        failed before): a caller that waits for it knows the save no longer depends on the
        training process."""
        self._sent = concurrent.futures.Future()
        return self._sent

    @property
    def released(self) -> concurrent.futures.Future[None]:
        """Done once the worker has answered for the last save handed to it (or is gone).
        Until then it may still read that save's staging buffers, even when the save was
        cancelled here: the next snapshot must not be taken into them before."""
        return self._released

    def _handed_over(self) -> None:
        """The save in flight no longer depends on this process (or will never be sent)."""
        if not self._sent.done():
            self._sent.set_result(None)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return (self.proc is not None and self.proc.poll() is None
                and self.channel is not None and not self.channel.closed)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start a worker (if none runs); its set-up runs while the caller goes on."""
        if self.alive:
            return
        self._stop(kill=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # the worker imports this very mithril_async (not another copy on its path)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        root = os.path.dirname(package)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, env.get("PYTHONPATH", "")) if p)
        # the child inherits this thread's signal mask: a job-wide signal during its start-up
        # waits until it has installed its handling (worker/server.py, serve)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            self.proc = subprocess.Popen(
                # -P: the working directory is not put on the path before PYTHONPATH
                [sys.executable, "-P", "-m", "mithril_async.worker",
                 "--fd", str(theirs.fileno()), "--trainer", str(os.getpid()),
                 "--nice", str(self.ctx.config.checkpointing.pipeline.background_nice)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, env=env, start_new_session=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        self._channel_id = next(_channel_ids)
        self.channel = Channel(ours, self._handle, name="trainer").start()
        self._ready = self.channel.call(
            "init", {**self._init,  # steps None: not listed here yet, the worker lists them
                     "steps": None if self.ctx.steps is None else sorted(self.ctx.steps)},
            [self._listener.fileno()] if self._listener is not None else None)
        self._reset_pending = False

    def reset_chains(self) -> None:
        """The live state no longer matches the staged bases (a restore): the worker's next
        save is a keyframe."""
        self._reset_pending = True

    def close(self, wait: bool = True) -> None:
        """Ask the worker to exit and wait for it (killed if it does not). ``wait=False``
        with a save still running: let the worker go (:meth:`abandon`). A worker still
        starting has nothing to finish: it is ended at once."""
        if self._listener is not None:  # a worker of rank 0 still running keeps its copy
            self._listener.close()
            self._listener = None
        if not wait and self._running:
            self.abandon()
            return
        self._stop(kill=not self.ready)

    def abandon(self) -> None:
        """Let the worker go without waiting, from any thread (a manager dropped without
        ``close()``): it finishes the saves it was handed, then exits, reaped on a thread
        of its own; one still starting has nothing to finish and is ended at once."""
        proc, channel = self.proc, self.channel
        self.proc = self.channel = None
        if proc is not None and not (self._running or self._ready_now()):
            with contextlib.suppress(OSError):
                proc.kill()
        if channel is not None:
            channel.close()
        if proc is not None:
            threading.Thread(target=proc.wait, name="mithril-worker-reap", daemon=True).start()

    def _ready_now(self) -> bool:
        return self._ready is not None and self._ready.done()

    def _forget(self) -> None:
        """In a forked child: close this process's copy of the channel (the socket alone:
        the connection stays the parent's) and forget the parent's worker."""
        channel, self.channel, self.proc, self._ready = self.channel, None, None, None
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.sock.close()
        listener, self._listener = self._listener, None  # rank 0's: the parent's to keep
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()

    def _stop(self, *, kill: bool) -> None:
        """End the worker: asked to exit (waited for, killed if it does not), or killed."""
        proc, channel = self.proc, self.channel
        self.proc = self.channel = None
        if channel is not None and not channel.closed and not kill:
            try:
                channel.call("close").result(EXIT_WAIT_S)
            except Exception:  # a worker that cannot answer is ended below
                kill = True
        if proc is not None and kill:
            with contextlib.suppress(OSError):
                proc.kill()
        if channel is not None:
            channel.close()
        if proc is not None:
            try:
                proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------------ saves
    async def run(self, job: SaveJob, metrics: dict[str, Any]) -> SaveResult:
        """Hand ``job``'s snapshot to the worker and return its result (raising the save's
        error as the worker reported it, or :class:`WorkerExited`)."""
        res = job.result
        assert res is not None, "begin() first"
        self._running += 1
        try:
            return await self._run(job, res, metrics)
        finally:
            self._running -= 1
            self._streaming = None  # the worker's copy-out requests are answered no more
            self._handed_over()
            job.snap.close()

    async def _run(self, job: SaveJob, res: SaveResult, metrics: dict[str, Any]
                   ) -> SaveResult:
        self.start()
        assert self.channel is not None and self._ready is not None
        channel = self.channel
        try:
            await asyncio.wrap_future(self._ready)
            if self._reset_pending:
                await asyncio.wrap_future(channel.call("reset_chains"))
                self._reset_pending = False
            self._send_segments(channel)
            self._streaming = (job.step, job.snap.stream)
            reply = self._hold(channel.call("save", self._describe(job, res, metrics)))
            self._handed_over()
            try:
                if job.snap.overlap is not None:
                    await self._report_overlap(job, channel)
                # shielded: a cancelled save still gets (and follows) the worker's answer
                answer = await asyncio.shield(asyncio.wrap_future(reply))
            except asyncio.CancelledError:
                self._cancel(channel, job.step)
                raise
        except ChannelClosed as err:
            # the other ranks' workers learn of it from their connection to this one's
            raise self._died(res, job.t0) from err
        update_result(res, answer["result"])
        self.ctx.history.append(res)
        if answer.get("error") is not None:
            raise error_of(answer["error"])
        if self.ctx.on_save is not None:
            self.ctx.on_save(res)
        return res

    def _hold(self, reply: concurrent.futures.Future[Any]) -> concurrent.futures.Future[Any]:
        """The save ``reply`` answers is the worker's until it answers: :attr:`released`
        is done only then, after its answer is followed here (:meth:`_follow`)."""
        released: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._released = released

        def answered(fut: concurrent.futures.Future[Any]) -> None:
            try:
                if not fut.cancelled() and fut.exception() is None:
                    self._follow(fut.result())
            finally:
                released.set_result(None)

        reply.add_done_callback(answered)
        return reply

    def _follow(self, answer: dict[str, Any]) -> None:
        """Take the worker's view of what saves hand on (whatever became of the save:
        committed, failed or cancelled): each item's base buffer set, which decides the
        set the next snapshot is staged into, and the run's committed steps after the
        commit and retention."""
        for name, base in answer.get("chains", {}).items():
            chain = self.ctx.chains.get(name)
            if chain is not None:
                chain.base_idx = base
        if answer.get("steps") is not None:
            self.ctx.steps = {int(s) for s in answer["steps"]}
        if self.tiers is not None and answer.get("tier_meta") is not None:
            self.tiers.committed_by_worker(VersionMeta.of_doc(answer["tier_meta"]))

    @staticmethod
    def _cancel(channel: Channel, step: int) -> None:
        """The save of ``step``, handed over, was cancelled here: the worker aborts it (its
        answer, awaited by :attr:`released`, says what became of it)."""
        channel.call("cancel", {"step": step})  # a closed channel: released already

    def _send_segments(self, channel: Channel) -> None:
        """Send the worker the segments it has not mapped yet, at most the channel's
        per-message limit of descriptors a message, all before the save that reads them (the
        channel keeps their order). Nothing waits for the worker to map them: a save is
        handed over once written, even to a worker that is stopped or busy. A batch the
        worker failed to map is sent again with the next save (and fails the save that
        needed it, which finds its segment missing)."""
        segments = self.arena.unsent(self._channel_id)
        for start in range(0, len(segments), MAX_FDS):
            batch = segments[start:start + MAX_FDS]
            idents = [i for i, _, _ in batch]
            self.arena.mark_sent(self._channel_id, idents)
            reply = channel.call("segments", {"segments": [[i, n] for i, _, n in batch]},
                                 [fd for _, fd, _ in batch])
            reply.add_done_callback(functools.partial(self._segments_mapped, self._channel_id,
                                                      idents))

    def _segments_mapped(self, channel_id: int, idents: list[int],
                         reply: concurrent.futures.Future[Any]) -> None:
        if reply.cancelled() or reply.exception() is not None:
            self.arena.mark_unsent(channel_id, idents)

    async def _report_overlap(self, job: SaveJob, channel: Channel) -> None:
        """Tell the worker when the overlapped copy into the staged buffers is complete (or
        torn: its error fails the save on every rank, as inline)."""
        assert job.snap.overlap is not None
        error: dict[str, Any] | None = None
        try:
            await job.snap.overlap.finished()
        except Exception as err:
            error = error_doc(err)
        await asyncio.wrap_future(channel.call("overlap_done", {"error": error}))

    def _describe(self, job: SaveJob, res: SaveResult, metrics: dict[str, Any]
                  ) -> dict[str, Any]:
        snap = job.snap
        items: dict[str, Any] = {}
        stream = None
        if snap.stream is not None:  # streamed: the worker asks for each chunk ("fetch")
            ring = snap.stream.ring
            slots = [self._place(f"slot {i} of the stream ring", b)
                     for i, b in enumerate(ring.buffers)]
            stream = {"slot_bytes": ring.slot_bytes, "slots": slots}
            for name in snap.skeletons:
                items[name] = {"skeleton": snap.skeletons[name], "area": 0, "tensors": [],
                               "stream": [[tname, t.dtype, list(t.shape), t.later] for tname, t
                                          in snap.stream.tensors.get(name, {}).items()]}
        for name, staged in snap.staged.items():
            tensors = []
            for tname, t in staged.tensors.items():
                at = self.arena.locate(t)
                if at is None and t.numel():
                    raise RuntimeError(f"{name}/{tname}: staged outside the shared memory")
                tensors.append(tensor_doc(tname, t, at))
            items[name] = {"skeleton": snap.skeletons[name], "area": snap.areas[name],
                           "tensors": tensors}
        return {"step": job.step, "t0": job.t0, "stall_s": res.stall_s,
                "waited_s": res.waited_s, "metrics": metrics, "items": items,
                "json_states": snap.json_states, "rng": snap.rng,
                "pieces": pieces_doc(snap.pieces), "overlap": snap.overlap is not None,
                "roles": snap.roles,
                "stream": stream,
                "tier_floor": None if self.tiers is None else self.tiers.floor}

    def _place(self, what: str, buffer: Any) -> list[int]:
        at = self.arena.locate(buffer)
        if at is None:
            raise RuntimeError(f"{what}: allocated outside the shared memory")
        return [at.segment, at.offset]

    def _fetch(self, args: dict[str, Any]) -> dict[str, Any]:
        """The worker encodes a streamed save: copy one chunk of a live tensor into the ring
        slot it leased (the copy-out inline saves run on their codec threads). An error
        (the snapshot torn by an in-place change, a save no longer streaming here) is
        answered with its type, and fails the save there."""
        try:
            current = self._streaming
            step = int(args["step"])
            if current is None or current[0] != step or current[1] is None:
                raise RuntimeError(f"no streamed save of step {step} is in progress")
            stream = current[1]
            t = stream.tensors[str(args["item"])][str(args["tensor"])]
            stream.fetch(SlotLease(stream.ring, int(args["slot"])), t, int(args["offset"]),
                         int(args["n"]))
            return {}
        except Exception as err:
            return {"error": error_doc(err)}

    def _died(self, res: SaveResult, t0: float) -> WorkerExited:
        proc = self.proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(5.0)
            except subprocess.TimeoutExpired:
                code = None
        how = ("is still running but closed its channel" if code is None
               else f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        err = WorkerExited(f"the checkpoint worker (pid {self.pid}) {how} during the save of "
                           f"step {res.step}; the next save starts a new worker")
        res.status, res.error = "failed", str(err)
        res.total_s = time.perf_counter() - t0
        self.ctx.history.append(res)
        self._stop(kill=True)
        return err

    # ------------------------------------------------------------------ its requests
    def _handle(self, method: str, args: dict[str, Any], fds: list[int]
                ) -> concurrent.futures.Future[Any] | dict[str, Any] | None:
        for fd in fds:
            os.close(fd)
        if method == "fetch":
            return self._fetch(args)
        if method == "log":  # a record of the worker's, logged here (worker/server.py)
            logging.getLogger(str(args.get("name") or "mithril_async")).log(
                int(args.get("level") or logging.WARNING), "%s", args.get("message"))
            return None
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_exception(ValueError(f"unknown request {method!r}"))
        return fut


class NodeTiers(Protocol):
    """What a worker's saves need of the trainer's tier layer
    (:class:`~mithril_async.tiers.layer.TierLayer`): the node folder the worker writes into,
    whether this rank keeps its books, the floor its claims go above; and, once the worker
    committed a version there, the replication and upload that follow it on the trainers'
    tier group."""

    @property
    def root(self) -> Path: ...

    @property
    def lead(self) -> bool: ...

    @property
    def floor(self) -> int: ...

    def committed_by_worker(self, meta: VersionMeta) -> None: ...
