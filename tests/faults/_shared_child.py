"""Processes that share one run, driven by ``test_shared_run.py``.

``python -m tests.faults._shared_child server``: imports torch and the library once (seconds
on a loaded machine), prints ``ready``, then reads one JSON spec per stdin line and forks a
*worker* for it, printing the worker's pid. The server never starts a thread, so forking is
safe. A worker connects to the Unix socket its spec names (``sock``) and reads commands from
it, answering each with one line.

``python -m tests.faults._shared_child SPEC_JSON``: one worker on stdin / stdout, for a
process that must be started afresh (e.g. under ``unshare --pid``, in another PID namespace).

A worker owns one CheckpointManager on the run the spec names (local disk, or S3 through an
endpoint) and obeys: ``open`` (start the manager with its start-up maintenance: cleanup of
abandoned saves), ``save STEP [rng|manifest|commit]`` (save; with a hold point the save stops
there, provably mid-flight, and the answer is ``held KEY``), ``release`` (let a held save go
on), ``submit STEP`` (save, answer at once), ``wait`` (the outcome of the save in flight),
``close``. A save's outcome is ``committed VERSION`` or ``failed TYPE: message``.

Hold points (what the test needs the writer to be doing): ``rng``: the RNG file's write, once
the model blob is durable (blobs written, before the commit's checks); ``manifest``: the
manifest's write (every check passed); ``commit``: the model blob's commit, while its temp
file exists (a streaming write in progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import IO, Any, cast

from mithril_async import CheckpointManager, parse_config
from mithril_async.claims import owner_identity
from mithril_async.save.results import SaveHandle
from mithril_async.storage.base import BlobWriter, Store
from mithril_async.storage.local import LocalStore
from mithril_async.storage.s3 import S3Store
from tests.faults._common import Counter, Net, config_text, metric, set_step

#: seconds a worker waits for its own save to reach a hold point: a safety net, not a timing
REACH_S = 120.0


class _Wrapped:
    """A blob writer that forwards to another (subclasses change ``commit``)."""

    def __init__(self, inner: BlobWriter, store: HoldingStore) -> None:
        self.inner, self.store = inner, store
        self.key = getattr(inner, "key", "")

    async def write(self, data: bytes | memoryview) -> None:
        await self.inner.write(data)

    async def commit(self) -> int:
        return await self.inner.commit()

    async def abort(self) -> None:
        await self.inner.abort()


class HeldWriter(_Wrapped):
    """The model blob's writer, whose commit waits for the release (its temp file exists)."""

    async def commit(self) -> int:
        await self.store.hold_here(self.key)
        return await self.inner.commit()


class Signalling(_Wrapped):
    """The model blob's writer, telling the ``rng`` hold point when the blob is durable."""

    async def commit(self) -> int:
        size = await self.inner.commit()
        self.store.model_done.set()
        return size


class HoldingStore:
    """A store that stops one save at the armed hold point until the test releases it."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.hold: str | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        self.model_done = threading.Event()
        self.held_key = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def hold_here(self, key: str) -> None:
        self.hold, self.held_key = None, key
        self.held.set()
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        if self.hold == "rng" and "/rng_rank" in key:
            # the model blob first: the save is then past its blob writes
            await asyncio.get_running_loop().run_in_executor(None, self.model_done.wait,
                                                             REACH_S)
            await self.hold_here(key)
        await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if self.hold == "manifest" and key.endswith("/manifest.json"):
            await self.hold_here(key)
        await self.inner.put_if_absent(key, data)

    def open_writer(self, key: str) -> BlobWriter:
        inner = self.inner.open_writer(key)
        if not key.endswith("/model.mckp"):
            return inner
        return HeldWriter(inner, self) if self.hold == "commit" else Signalling(inner, self)

    def arm(self, hold: str | None) -> None:
        """Stop the next save at ``hold`` (None: let it run)."""
        self.hold, self.held_key = hold, ""
        for event in (self.held, self.release, self.model_done):
            event.clear()


def _store(spec: dict[str, Any]) -> tuple[Store, str]:
    if spec.get("s3"):
        s3 = spec["s3"]
        return S3Store(s3["bucket"], s3["prefix"], endpoint_url=s3["endpoint"],
                       region_name="us-east-1", part_size=256 * 1024,
                       min_part_size=256 * 1024, max_attempts=10, max_concurrency=4), "runs"
    runs = Path(spec["runs"])
    return LocalStore(runs.parent), runs.name


def _outcome(m: CheckpointManager, handle: SaveHandle) -> str:
    try:
        res = handle.result(REACH_S)
    except Exception as err:
        with contextlib.suppress(Exception):
            m.check_for_errors()  # the manager reports it once more: consumed here
        return f"failed {type(err).__name__}: {err}"
    return f"committed {res.version_id}"


def worker(spec: dict[str, Any], cmd_in: IO[str], out: IO[str]) -> None:
    def say(line: str) -> None:
        out.write(line.replace("\n", " ") + "\n")
        out.flush()

    runs = Path(spec.get("runs") or "/nonexistent/runs")
    cfg = parse_config(config_text(runs, "run1", delta=spec.get("delta", False),
                                   keep_last=spec.get("keep_last", 10_000)))
    pipe = cfg.checkpointing.pipeline.model_copy(update={
        k: spec[k] for k in ("claim_stale_s", "orphan_age_s") if k in spec})
    cfg.checkpointing.pipeline = pipe
    inner, prefix = _store(spec)
    store = HoldingStore(inner)
    model, counter = Net(spec.get("d", 128)), Counter()
    m = CheckpointManager(cfg, {"model": model, "data": counter},
                          store=cast(Store, store), runs_prefix=prefix)
    handle: SaveHandle | None = None
    say(f"ready {json.dumps(owner_identity())}")
    for line in cmd_in:
        op, *args = line.split()
        if op == "open":
            _ = m.loop
            say("opened")
        elif op in ("save", "submit"):
            step, hold = int(args[0]), (args[1] if len(args) > 1 else None)
            set_step(model, counter, step)
            store.arm(hold)
            handle = m.save_nowait(step, metrics={"loss": metric(step)})
            if op == "submit":
                say("submitted")
            elif hold is None:
                say(_outcome(m, handle))
            elif store.held.wait(REACH_S):
                say(f"held {store.held_key}")
            else:
                say(f"never held: {_outcome(m, handle)}")
        elif op == "release":
            store.release.set()
            assert handle is not None
            say(_outcome(m, handle))
        elif op == "wait":
            assert handle is not None
            say(_outcome(m, handle))
        elif op == "close":
            store.release.set()
            try:
                m.close()
            except Exception as err:
                say(f"close-failed {type(err).__name__}: {err}")
            else:
                say("closed")
            return
        else:
            say(f"unknown command {line!r}")


def serve() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they exit
    print("ready", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.environ.update(spec.get("env", {}))
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(spec["sock"])
                    with sock.makefile("r") as cmd_in, sock.makefile("w") as out:
                        worker(spec, cmd_in, out)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve()
    else:
        worker(json.loads(sys.argv[1]), sys.stdin, sys.stdout)
