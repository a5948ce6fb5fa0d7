"""The checkpoint worker: a process of its own that runs every save's background part.

Started by a training process's manager (``python -m mithril_async.worker``, never a fork
or a re-import of the training script), it builds from the run's configuration what the
pipeline needs (store, catalog, codec pool, encoder, delta chains, retention) (with
``[checkpointing.tiers]``: the node folder and the node's part of the tier commit, the
background replication and upload staying with the trainer's tier layer) and then, for
each save the trainer hands over, runs :class:`~mithril_async.save.job.SaveJob` on a snapshot
that lies in the trainer's shared staging memory (mapped here, never copied): version
agreement and claim, encoding, writes (disk, S3), the commit, aliases and retention. On
several ranks the protocol's steps (agree, gather, outcome) run among the job's workers
(:mod:`~mithril_async.worker.peers`), so a save every rank handed over commits even when
every trainer is gone.

When the trainer goes away (killed, crashed, exited) the save in flight is finished (and
committed, where it needs no other rank) and the worker exits; it never waits on a dead
trainer. It learns of that death from the channel's end of file, and also from its parent
process changing (``PR_SET_PDEATHSIG`` and a slow poll of ``getppid``): a child the trainer
forked may hold the trainer's end of the socket open. A save whose overlapped copy the
trainer never finished is abandoned (nothing published, its claim removed). Signals meant
for the whole job (SIGTERM, SIGINT, SIGHUP: ``scancel``, Kubernetes, Ctrl-C) do not end the
worker: it keeps serving a trainer that lives on (a signal save), and finishes what it was
handed when the trainer dies of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from mithril_async.catalog import RunCatalog
from mithril_async.config import Config
from mithril_async.errors import TrainerExited
from mithril_async.layout import RunLayout
from mithril_async.memory.ring import SlotRing
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.pipeline.pool import CodecPool
from mithril_async.retention import from_config
from mithril_async.run_store import open_run_store
from mithril_async.save.buffers import BufferSet
from mithril_async.save.context import SaveContext
from mithril_async.save.coordinator import Coordinator, LocalCoordinator
from mithril_async.save.job import SaveJob
from mithril_async.save.results import SaveResult
from mithril_async.save.snapshot import HandedOff
from mithril_async.storage.base import Store
from mithril_async.storage.local import LocalStore
from mithril_async.tiers.commit import NodeCommit, TierCoordinator
from mithril_async.tiers.node_store import NodeStore
from mithril_async.worker.channel import Channel
from mithril_async.worker.handoff import (
    config_of,
    error_doc,
    error_of,
    pieces_of,
    result_doc,
    tensor_of,
)
from mithril_async.worker.peers import PeerCoordinator, save_scope
from mithril_async.worker.shm import BufferAt, SegmentMap
from mithril_async.worker.signals import JOB_SIGNALS
from mithril_async.worker.streamed import RemoteStream

__all__ = ["WorkerServer", "serve"]

log = logging.getLogger("mithril_async")

#: the signal the kernel sends the worker when its parent dies (PR_SET_PDEATHSIG)
PARENT_DEATH_SIGNAL = signal.SIGHUP
#: seconds between two checks that the trainer is still the parent (a fallback for the
#: parent-death signal, which Linux sends when the creating *thread* exits)
PARENT_POLL_S = 2.0
_PR_SET_PDEATHSIG = 1


class WorkerServer:
    """Serves one trainer over ``sock`` until it closes the channel (see module doc)."""

    def __init__(self, sock: socket.socket, trainer_pid: int | None = None) -> None:
        #: the training process this worker serves (its parent)
        self.trainer_pid = os.getppid() if trainer_pid is None else trainer_pid
        self.segments = SegmentMap()
        self.loop: BackgroundLoop | None = None
        self.ctx: SaveContext | None = None
        #: with tiers: the node folder's part of each commit (what a save hands back)
        self.node: NodeCommit | None = None
        self.busy = 0
        self.gone = threading.Event()
        #: the save in flight's stand-in for the trainer's overlapped copy, and a verdict on
        #: it that arrived before the save did
        self._gate: _OverlapGate | None = None
        self._early: dict[str, Any] | None = None
        #: the save in flight's step and the task running its job (what "cancel" stops)
        self._job: tuple[int, asyncio.Task[SaveResult]] | None = None
        #: set on the loop once the trainer is gone: fails every overlap gate still closed
        self._left: TrainerExited | None = None
        self._lock = threading.Lock()
        self._exiting = False
        self._hung_up = False
        self.channel = Channel(sock, self._handle, on_close=self._trainer_gone, name="worker")
        self.channel.start()

    # ------------------------------------------------------------------ requests
    def _handle(self, method: str, args: dict[str, Any], fds: list[int]
                ) -> concurrent.futures.Future[Any] | Any:
        if method == "init":
            return self._init(args, fds)
        if method == "segments":  # the trainer's staging segments, mapped before a save
            self.segments.add([(int(i), int(n)) for i, n in args.get("segments", [])], fds)
            return len(fds)
        if method == "save":  # its segments came before it ("segments")
            return self._submit(self._save(args))
        if method == "cancel":
            return self._submit(self._cancel(args))
        if method == "overlap_done":
            return self._submit(self._overlap_done(args))
        if method == "reset_chains":
            return self._submit(self._reset())
        if method == "close":
            self.gone.set()
            return True
        raise ValueError(f"unknown request {method!r}")

    @property
    def _overlap(self) -> _OverlapGate | None:
        return self._gate

    @_overlap.setter
    def _overlap(self, gate: _OverlapGate | None) -> None:
        """A gate made after the trainer left can never be opened by it: failed at once."""
        self._gate = gate
        if gate is not None and self._left is not None:
            gate.open(self._left)

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        assert self.loop is not None, "init first"
        return self.loop.submit(coro)

    def _init(self, args: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        config: Config = config_of(args["config"])
        cfg = config.checkpointing
        rank, world = int(args["rank"]), int(args["world_size"])
        tiers = args.get("tiers")
        store: Store
        if tiers is not None:  # the node folder, as the trainer's tier layer has it
            store, prefix = NodeStore(LocalStore(Path(str(tiers["root"])))), "runs"
        else:
            store, prefix = open_run_store(cfg)
        layout = RunLayout(args.get("runs_prefix") or prefix, str(args["run_id"]))
        catalog = RunCatalog(store, layout, claim_stale_s=cfg.pipeline.claim_stale_s)
        threads = cfg.compression.threads or max(1, os.cpu_count() or 1)
        pool = CodecPool(threads, "mithril-codec")
        self.loop = BackgroundLoop()
        coordinator: Coordinator = LocalCoordinator()
        if world > 1:  # rank 0 was handed the socket its peers connect to
            listener = socket.socket(fileno=fds[0]) if rank == 0 else None
            coordinator = PeerCoordinator(rank, world, args["peers"], listener)
            self.loop.run(coordinator.start())
        if isinstance(store, NodeStore):  # and the node folder's part of each commit
            self.node = NodeCommit(store, layout, bool(tiers and tiers.get("lead")))
            coordinator = TierCoordinator(coordinator, self.node)
        self.ctx = SaveContext.for_run(
            # the state's item names (what a rank's discard of an aborted save removes)
            config, dict.fromkeys(args.get("items") or ()), store, layout, catalog,
            coordinator, pool, retention=None if args.get("keep_all") else from_config(cfg),
            sharded_model=bool(args.get("sharded_model")),
            new_area=BufferSet)  # it only holds what the trainer staged
        steps = args.get("steps")  # None: the trainer had not listed them yet
        self.ctx.steps = set(steps if steps is not None
                             else self.loop.run(catalog.committed_steps()))
        return {"pid": os.getpid()}

    async def _save(self, args: dict[str, Any]) -> dict[str, Any]:
        ctx = self.ctx
        assert ctx is not None
        self.busy += 1
        try:
            step = int(args["step"])
            stream = self._stream(step, args["stream"]) if args.get("stream") else None
            items: dict[str, dict[str, Any]] = {}
            for name, item in args["items"].items():
                if stream is not None:
                    for tname, dtype, shape, later in item.get("stream") or ():
                        stream.add(name, str(tname), str(dtype),
                                   tuple(int(s) for s in shape), bool(later))
                tensors = {}
                for doc in item["tensors"]:
                    tname, dtype, shape, at = tensor_of(doc)
                    tensors[tname] = self.segments.view(at, dtype, shape)
                items[name] = {"skeleton": item["skeleton"], "area": int(item["area"]),
                               "tensors": tensors}
            if self.node is not None:
                self.node.floor, self.node.committed = int(args.get("tier_floor") or 0), None
            overlap = _OverlapGate() if args.get("overlap") else None
            self._overlap = overlap
            if overlap is not None and self._early is not None:
                await self._overlap_done(self._early)
            self._early = None
            job = SaveJob(ctx, step, float(args["t0"]),
                          HandedOff(items=items, json_states=args.get("json_states") or {},
                                    rng=args.get("rng") or {},
                                    pieces=pieces_of(args.get("pieces") or {}),
                                    stream=stream, roles=args.get("roles") or {}),
                          overlap)
            res = SaveResult(job.step, stall_s=float(args.get("stall_s", 0.0)),
                             waited_s=float(args.get("waited_s", 0.0)))
            job.adopt_result(res, args.get("metrics") or {})
            task = asyncio.ensure_future(job.run())
            self._job = (job.step, task)
            try:
                async with save_scope(ctx.coordinator, job.step):
                    await task
            except asyncio.CancelledError:
                if self._job is not None:  # not the trainer's "cancel" (see _cancel)
                    raise
                return self._answer(res, cancelled=True)  # aborted as inline
            except BaseException as err:
                return self._answer(res, error=err)
            return self._answer(res)
        finally:
            self.busy -= 1
            self._overlap = None
            self._job = None
            if self.gone.is_set():
                self._exit_soon()

    def _stream(self, step: int, doc: dict[str, Any]) -> RemoteStream:
        """The streamed save's ring, over the trainer's slots (mapped like its staging)."""
        size = int(doc["slot_bytes"])
        slots = [self.segments.view(BufferAt(int(seg), int(off)), "uint8", (size,)).data
                 for seg, off in doc["slots"]]
        for slot in slots:
            slot.flags.writeable = False  # the trainer writes them, the encoder only reads
        return RemoteStream(step, SlotRing.over(slots, size), self.channel.call)

    def _answer(self, res: SaveResult, *, error: BaseException | None = None,
                cancelled: bool = False) -> dict[str, Any]:
        """A save's answer: its result, and what the trainer's own view of the run follows
        (each item's base buffer set, the committed steps after commit and retention)."""
        assert self.ctx is not None
        self.ctx.history.clear()  # the trainer records each result, from this answer
        out: dict[str, Any] = {"result": result_doc(res), "chains": self._chains(),
                               "steps": sorted(self.ctx.steps or ())}
        if self.node is not None and self.node.committed is not None:
            # committed on the node folder (even if cancelled after): the trainer's tiers
            # replicate and upload it
            out["tier_meta"] = self.node.committed.to_doc()
        if error is not None:
            out["error"] = error_doc(error)
        if cancelled:
            out["cancelled"] = True
        return out

    async def _cancel(self, args: dict[str, Any]) -> bool:
        """The trainer cancelled the save of ``step``: its job is cancelled (it aborts as an
        inline save does; one already committed stays committed). Whether it still ran."""
        job, step = self._job, int(args["step"])
        if job is None or job[0] != step or job[1].done():
            return False
        self._job = None  # marks the cancellation as the trainer's (see _save)
        job[1].cancel()
        return True

    async def _overlap_done(self, args: dict[str, Any]) -> bool:
        gate = self._overlap
        if gate is None:
            self._early = args
        else:
            gate.open(error_of(args["error"]) if args.get("error") else None)
        return True

    def _chains(self) -> dict[str, int | None]:
        """Each item's base buffer set after the save (the trainer stages into the other)."""
        assert self.ctx is not None
        return {name: c.base_idx for name, c in self.ctx.chains.items()}

    async def _reset(self) -> bool:
        assert self.ctx is not None
        for chain in self.ctx.chains.values():
            chain.reset()
        if self.ctx.lossy is not None:
            self.ctx.lossy.reset()  # nor is the lossy chain's reconstruction the live state
        return True

    # ------------------------------------------------------------------ ending
    def check_trainer(self) -> None:
        """Hang up if the trainer is no longer this process's parent (it died: the worker
        was handed to another parent)."""
        if os.getppid() != self.trainer_pid:
            self.hang_up()

    def hang_up(self) -> None:
        """The trainer died while its end of the channel may still be open (a child it
        forked holds it): stop receiving. What it sent before dying is still read, then the
        channel ends as on its death (:meth:`_trainer_gone`); nothing more is sent to it."""
        if self._hung_up:  # no lock: a signal handler may interrupt a check (twice: harmless)
            return
        self._hung_up = True
        with contextlib.suppress(OSError):
            self.channel.sock.shutdown(socket.SHUT_RDWR)

    def _trainer_gone(self) -> None:
        """The trainer closed the channel or died: finish what it handed over, then exit.
        Decided on the loop, after every request received before (a save, the end of its
        overlapped copy)."""
        self.gone.set()
        loop = self.loop
        if loop is None:  # never initialised: nothing was handed over
            self._exit_soon()
            return
        try:
            loop.submit(self._wind_down())
        except RuntimeError:  # the loop is closed: the exit is under way
            self._exit_soon()

    async def _wind_down(self) -> None:
        """On the loop: an overlapped copy the trainer never reported finished never will
        be, so its save is abandoned; with nothing running the worker exits now (a save
        running exits it when it ends)."""
        self._left = TrainerExited(
            f"the training process (pid {self.trainer_pid}) went away before its overlapped "
            "snapshot copy finished; the save is abandoned")
        gate = self._gate
        if gate is not None:
            gate.open(self._left)
        if self.busy == 0:
            self._exit_soon()

    def _exit_soon(self) -> None:
        with self._lock:
            if self._exiting:
                return
            self._exiting = True
        threading.Thread(target=self._exit, name="mithril-worker-exit", daemon=True).start()

    def _exit(self) -> None:
        ctx, loop = self.ctx, self.loop
        if loop is not None and ctx is not None:
            try:
                loop.run(ctx.store.close())
            except Exception:  # the process ends anyway
                log.exception("closing the store")
            ctx.coordinator.close()  # leaving the workers' group: the others learn it at once
            loop.close()
        if ctx is not None:
            ctx.pool.shutdown(wait=True)
        os._exit(0)


class _OverlapGate:
    """Stands in for the trainer's overlapped copy: finished when the trainer says so."""

    def __init__(self) -> None:
        self._done = asyncio.Event()
        self._error: BaseException | None = None
        self.result: SaveResult | None = None

    def open(self, error: BaseException | None) -> None:
        """The first verdict stands (the trainer's, or its departure's)."""
        if self._done.is_set():
            return
        self._error = error
        self._done.set()

    async def finished(self) -> None:
        await self._done.wait()
        if self._error is not None:
            raise self._error


class ToTrainerLog(logging.Handler):
    """Sends the worker's log records to its trainer, which logs them through its own
    ``logging`` set-up (handlers, files, levels: a held version's warning reaches the same
    log as everything else of the training job). Once the channel is closed (the trainer is
    gone and the worker finishes the save in flight) records go to stderr."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel
        self.fallback = logging.StreamHandler()
        self.fallback.setFormatter(logging.Formatter(
            "mithril-worker %(process)d %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.notify("log", {"name": record.name, "level": record.levelno,
                                        "message": self.format(record)})
        except Exception:  # closed or broken: the trainer cannot log it any more
            self.fallback.handle(record)


def _parent_death_signal(signum: int) -> None:
    """Ask Linux to send ``signum`` when the parent goes away (nothing elsewhere: the
    ``getppid`` poll covers it)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def serve(fd: int, nice: int = 0, trainer_pid: int | None = None) -> None:
    """Run a worker on the inherited socket ``fd`` until its trainer (``trainer_pid``, the
    parent) goes away; ``nice``: added to its nice value first, so every thread it starts
    yields the cores to training (``background_nice``).

    The trainer starts the worker with :data:`JOB_SIGNALS` blocked, so a job-wide signal that
    comes during its start-up waits here until the handler below is installed: such a
    signal only makes the worker check that its trainer still lives."""
    if nice:
        os.nice(nice)
    server = WorkerServer(socket.socket(fileno=fd), trainer_pid)
    for signum in JOB_SIGNALS:
        signal.signal(signum, lambda _s, _f: server.check_trainer())
    _parent_death_signal(PARENT_DEATH_SIGNAL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    server.check_trainer()  # it may have died before the parent-death signal was set
    # the trainer's logging decides what is shown; MITHRIL_WORKER_LOG: what is sent to it
    log.setLevel(os.environ.get("MITHRIL_WORKER_LOG", "INFO"))
    log.addHandler(ToTrainerLog(server.channel))
    log.propagate = False
    while True:  # the server exits the process once its trainer is gone (os._exit)
        time.sleep(PARENT_POLL_S)  # a signal's handler runs in here
        server.check_trainer()
