"""Issue 19, items 1-4: other processes on the same run never break a live save, and every
committed version stays restorable.

Every writer here is a real process (forked from one server that imported torch once:
``_shared_child.py``); the process under test is stopped at a named point of its save (a held
write), so "mid-save" is a fact, not a timing. What each test proves, and what the code before
issue 19 did instead:

- a manager started in another PID namespace with the same hostname (``unshare --pid``) leaves
  a live save alone (it used to see the writer's pid as dead and delete its folder), and the
  writer's claim heartbeat advances while it is held;
- without ``unshare``, the same case with the namespace id faked in a claim file;
- a writer whose claim was removed or replaced meanwhile fails with ``ClaimLost`` and
  publishes nothing (it used to commit a manifest whose blobs were gone);
- two writers with delta chains: the base another writer's retention deleted is replaced by
  a keyframe, and a base a live save's claim names is not deleted (``restore`` used to raise
  ``MissingPrevious``);
- ``mithril gc`` leaves a running save's temp file and claim alone and says why in
  ``--dry-run`` (it removed every temp file, and the save failed);
- on S3, a restore-only manager aborts nothing and a starting manager spares a live save's
  upload (both aborted any upload older than ``orphan_age_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager
from mithril_async.catalog import RunCatalog
from mithril_async.claims import (
    CLAIM_STALE_S,
    claim_doc_stale,
    heartbeat_interval,
    owner_identity,
)
from mithril_async.cli import main
from mithril_async.commands import gc as gc_command
from mithril_async.config import PipelineConfig
from mithril_async.layout import RunLayout
from mithril_async.storage.local import LocalStore
from tests.faults._common import Counter, Net, make_config, matches_step
from tests.faults._s3_child import open_store
from tests.s3_server import DUMMY_ENV, MotoS3, fault_proxy, wait_until

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
#: seconds to wait for an answer of a worker: a safety net, not a timing
REACH_S = 180.0


class Worker:
    """One writer process: a command in, one answer line out (see ``_shared_child.py``)."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.pid, self.conn = pid, conn
        self.stopped = False
        conn.settimeout(REACH_S)
        self._r, self._w = conn.makefile("r"), conn.makefile("w")
        ready = self._line()
        assert ready.startswith("ready "), ready
        self.identity: dict[str, Any] = json.loads(ready.split(" ", 1)[1])

    def _line(self) -> str:
        line = self._r.readline()
        assert line, f"worker {self.pid} exited"
        return line.rstrip("\n")

    def ask(self, command: str) -> str:
        self._w.write(command + "\n")
        self._w.flush()
        return self._line()

    def stop(self) -> None:
        reply = self.ask("close")
        self.stopped = True
        self.conn.close()
        assert reply == "closed", f"worker {self.pid}: {reply}"


class Server:
    """The fork server: one import of torch, a worker per ``spawn``."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="msr"))  # short: a socket path has a limit
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.faults._shared_child",
                                      "server"], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        self.workers: list[Worker] = []

    def spawn(self, **spec: Any) -> Worker:
        path = str(self.dir / f"w{len(self.workers)}")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(REACH_S)
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({**spec, "sock": path}) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
            conn, _ = listener.accept()
        worker = Worker(conn, pid)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for w in self.workers:  # a failed test may leave a worker held: end it (ours, by pid)
            w.conn.close()
            if not w.stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    try:
        yield srv
    finally:
        srv.close()


def restores(runs: Path, d: int = 128, **store: Any) -> tuple[int, list[int]]:
    """A reader (restore only, so it changes nothing): ``latest`` and every committed version
    restore bit for bit; returns (latest step, committed steps)."""
    model, counter = Net(d), Counter()
    kw: dict[str, Any] = {"store": open_store(**store), "runs_prefix": "runs"} if store else {}
    m = CheckpointManager(make_config(runs), {"model": model, "data": counter}, **kw)
    try:
        latest = m.restore_sync("latest")
        assert matches_step(model, counter, latest)
        steps = m.all_steps()
        for s in steps:
            assert m.restore_sync(s) == s and matches_step(model, counter, s), s
    finally:
        m.close()
    return latest, steps


def vdir(runs: Path, n: int) -> Path:
    return runs / "run1" / "versions" / f"v{n:06d}"


def claim_of(runs: Path, n: int) -> dict[str, Any]:
    return dict(json.loads((vdir(runs, n) / "_claim.json").read_text()))


def manifest_of(runs: Path, n: int) -> dict[str, Any]:
    return dict(json.loads((vdir(runs, n) / "manifest.json").read_text()))


def _unshare_error() -> str | None:
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return repr(err)
    return None if r.returncode == 0 else r.stderr.strip() or f"exit {r.returncode}"


# ------------------------------------------------------------------------ item 1: claims
def test_cleanup_in_another_pid_namespace_leaves_a_live_save_alone(server: Server,
                                                                   tmp_path: Path) -> None:
    err = _unshare_error()
    if err is not None:
        pytest.skip(f"unshare --pid --fork --mount-proc is not permitted here ({err}); "
                    "test_a_fresh_claim_from_another_pid_namespace_is_live covers the rule")
    runs = tmp_path / "runs"
    w = server.spawn(runs=str(runs), claim_stale_s=0.4)  # a heartbeat every 0.1 s
    assert w.ask("save 1") == "committed v000001"
    assert w.ask("save 2 manifest") == "held runs/run1/versions/v000002/manifest.json"
    first = claim_of(runs, 2)
    assert {k: first[k] for k in ("host", "boot", "pidns", "pid")} == w.identity
    assert len(first["token"]) == 32
    # the held writer's heartbeat goes on: its claim is renewed, never stale
    assert wait_until(lambda: claim_of(runs, 2)["hb"] > first["hb"], REACH_S)
    # a manager starts on the run in another PID namespace, same host and boot, and runs the
    # start-up cleanup (with orphan_age_s = 0: any leftover would count as old)
    spec = json.dumps({"runs": str(runs), "orphan_age_s": 0})
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                        "tests.faults._shared_child", spec], input="open\nclose\n",
                       capture_output=True, text=True, timeout=REACH_S, cwd=ROOT, env=ENV)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[1:] == ["opened", "closed"], (r.stdout, r.stderr)
    other = json.loads(lines[0].split(" ", 1)[1])
    assert other["pidns"] != first["pidns"]  # really another namespace ...
    assert (other["host"], other["boot"]) == (first["host"], first["boot"])  # ... same host
    # where the writer's pid does not exist (os.kill(pid, 0) fails): nothing was removed
    assert (vdir(runs, 2) / "model.mckp").is_file()
    assert claim_of(runs, 2)["token"] == first["token"]
    assert w.ask("release") == "committed v000002"
    assert restores(runs) == (2, [1, 2])
    w.stop()


def test_a_fresh_claim_from_another_pid_namespace_is_live(tmp_path: Path) -> None:
    """The rule itself, with the namespace id faked in claim files (no unshare needed)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    me, now = owner_identity(), time.time()
    elsewhere = {**me, "pidns": "pid:[1]", "pid": gone.pid}  # same host and boot
    claims = {
        2: {**elsewhere, "hb": now},  # pid not alive here, heartbeat fresh: live
        3: {**elsewhere, "hb": now - 2 * CLAIM_STALE_S},  # heartbeat stopped: abandoned
        4: {**me, "pid": gone.pid, "hb": now},  # this namespace, no such pid: dead
        5: {"host": me["host"], "pid": gone.pid, "t": now},  # no namespace known: heartbeat
        6: {**me, "hb": now - 2 * CLAIM_STALE_S},  # this very process: never abandoned
    }
    live = {2, 5, 6}
    for n, doc in claims.items():
        assert claim_doc_stale(doc, CLAIM_STALE_S) is (n not in live), n
    store = LocalStore(tmp_path)
    cat = RunCatalog(store, RunLayout("runs", "run1"))

    async def body() -> list[str]:
        for n, doc in claims.items():
            await store.put(cat.layout.claim_key(n), json.dumps(doc).encode())
            await store.put(cat.layout.model_key(n, "mckp"), b"partial")
        return await cat.clean_unfinished()

    assert asyncio.run(body()) == [cat.layout.version_dir(n) for n in (3, 4)]
    assert sorted(p.name for p in (tmp_path / "runs" / "run1" / "versions").iterdir()) == [
        f"v{n:06d}" for n in sorted(live)]
    # the defaults agree: config, catalog, and gc (which must not import the config models)
    defaults = PipelineConfig()
    assert defaults.claim_stale_s == CLAIM_STALE_S == gc_command.CLAIM_STALE_S
    assert defaults.orphan_age_s == gc_command.ORPHAN_AGE_S
    assert heartbeat_interval(CLAIM_STALE_S) == 30.0 and heartbeat_interval(0.4) == 0.1


def test_a_save_whose_claim_was_taken_publishes_nothing(server: Server,
                                                        tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    w = server.spawn(runs=str(runs))
    assert w.ask("save 1") == "committed v000001"
    # held after its blobs are durable, before its commit's checks
    assert w.ask("save 2 rng") == "held runs/run1/versions/v000002/rng_rank0000.json"
    # another process judged the claim abandoned (a too-short bound here) and removed it
    cat = RunCatalog(LocalStore(tmp_path), RunLayout("runs", "run1"))
    assert asyncio.run(cat.clean_unfinished(stale_after_s=-1)) == ["runs/run1/versions/v000002"]
    reply = w.ask("release")
    assert reply.startswith("failed ClaimLost: runs/run1/versions/v000002/_claim.json"), reply
    assert not (vdir(runs, 2) / "manifest.json").exists()
    # a claim replaced by another writer: its folder is that writer's, nothing is deleted
    assert w.ask("save 3 rng") == "held runs/run1/versions/v000003/rng_rank0000.json"
    theirs = {**claim_of(runs, 3), "token": "another writer's"}
    (vdir(runs, 3) / "_claim.json").write_text(json.dumps(theirs))
    (vdir(runs, 3) / "theirs.bin").write_bytes(b"theirs")
    assert w.ask("release").startswith("failed ClaimLost: runs/run1/versions/v000003/")
    assert claim_of(runs, 3) == theirs
    assert (vdir(runs, 3) / "theirs.bin").read_bytes() == b"theirs"
    assert not (vdir(runs, 3) / "manifest.json").exists()
    assert w.ask("save 4") == "committed v000004"  # the writer goes on
    assert restores(runs) == (4, [1, 4])
    w.stop()


# ------------------------------------------------------------- item 2: two delta writers
def test_two_writers_with_delta_chains_keep_every_version_restorable(server: Server,
                                                                      tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    a = server.spawn(runs=str(runs), delta=True, keep_last=2)
    b = server.spawn(runs=str(runs), delta=True, keep_last=2)
    assert a.ask("save 1") == "committed v000001"
    assert b.ask("save 2") == "committed v000002"
    assert b.ask("save 3") == "committed v000003"
    assert not vdir(runs, 1).exists()  # B's retention deleted A's delta base
    # A's next save was a delta against its in-memory v000001: written as a keyframe instead
    assert a.ask("save 4") == "committed v000004"
    assert manifest_of(runs, 4)["model"]["base"] is None
    assert restores(runs) == (4, [2, 3, 4])
    # while A's next save runs, its claim names its base; B's retention must keep it
    assert a.ask("save 10 manifest") == "held runs/run1/versions/v000005/manifest.json"
    assert claim_of(runs, 5)["bases"] == ["v000004"]
    assert b.ask("save 6") == "committed v000006"
    assert b.ask("save 7") == "committed v000007"  # keep_last = 2 alone would drop v000004
    assert (vdir(runs, 4) / "manifest.json").is_file()
    assert a.ask("release") == "committed v000005"
    assert manifest_of(runs, 5)["model"]["base"]["version_id"] == "v000004"  # a real delta
    latest, steps = restores(runs)
    assert latest == 10 and 10 in steps
    a.stop()
    b.stop()


# ------------------------------------------------------------------------- item 3: gc
def test_gc_leaves_a_running_save_alone_and_says_why(server: Server, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    w = server.spawn(runs=str(runs), d=1024)  # 6 MB: the model blob streams via a temp file
    assert w.ask("save 1") == "committed v000001"
    assert w.ask("save 2 commit") == "held runs/run1/versions/v000002/model.mckp"
    streaming = list(vdir(runs, 2).glob(".tmp-model.mckp.*"))
    assert len(streaming) == 1  # mid-save, provably: its blob is still a temp file
    young, old = vdir(runs, 1) / ".tmp-young.1.a", vdir(runs, 1) / ".tmp-old.1.b"
    young.write_bytes(b"y")
    old.write_bytes(b"o")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert main(["gc", str(runs), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["runs"]["run1"]
    why = {i["what"]: i["why"] for i in plan if i["kind"] == "skip"}
    rel: Callable[[Path], str] = lambda p: str(p.relative_to(tmp_path))  # noqa: E731
    assert why[rel(vdir(runs, 2))].startswith(f"live save: pid {w.pid} ")
    assert why[rel(streaming[0])] == "part of a live save"
    assert "younger than --orphan-age 600 s" in why[rel(young)]
    assert [(i["kind"], i["what"]) for i in plan if i["kind"] != "skip"] == [
        ("incomplete", rel(old))]
    assert main(["gc", str(runs)]) == 0
    assert streaming[0].exists() and young.exists() and not old.exists()
    assert main(["gc", str(runs), "--orphan-age", "0"]) == 0  # every leftover counts as old
    assert streaming[0].exists() and not young.exists()  # but a live save's are never touched
    assert claim_of(runs, 2)["pid"] == w.pid
    assert w.ask("release") == "committed v000002"
    assert restores(runs, d=1024) == (2, [1, 2])
    w.stop()


# ---------------------------------------------------------------------- item 4: S3 uploads
def test_opening_an_s3_run_never_aborts_a_live_upload(server: Server) -> None:
    with MotoS3() as s3, fault_proxy(s3) as proxy:
        prefix = s3.unique_prefix("shared")
        w = server.spawn(s3={"endpoint": proxy.endpoint_url, "bucket": s3.bucket,
                             "prefix": prefix}, d=256, env=DUMMY_ENV)
        assert w.ask("save 1") == "committed v000001"
        held = proxy.fail(lambda r: r.is_upload_part and r.query["partNumber"] == ["2"]
                          and "/v000002/" in r.path, "hold", times=1)
        assert w.ask("submit 2") == "submitted"
        assert wait_until(lambda: held.hits >= 1, REACH_S)
        assert len(s3.uploads(prefix)) == 1  # the model blob's upload is in flight
        store = {"endpoint": s3.endpoint_url, "bucket": s3.bucket, "prefix": prefix}
        # an evaluation job restores while the upload runs, with orphan_age_s = 0 (as if the
        # upload had run for longer than the orphan age): it aborts nothing
        assert restores(Path("/nonexistent/runs"), d=256, **store) == (1, [1])
        assert len(s3.uploads(prefix)) == 1
        # a manager that starts for saving cleans the run, but the upload's claim is live
        model, counter = Net(256), Counter()
        with CheckpointManager(make_config(Path("/nonexistent/runs")),
                               {"model": model, "data": counter}, store=open_store(**store),
                               runs_prefix="runs"):
            pass
        assert len(s3.uploads(prefix)) == 1
        proxy.clear()  # the held part is answered with a reset: retried, the save goes on
        assert w.ask("wait") == "committed v000002"
        assert s3.uploads(prefix) == []
        assert restores(Path("/nonexistent/runs"), d=256, **store) == (2, [1, 2])
        w.stop()
