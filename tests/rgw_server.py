"""A real Ceph RADOS Gateway for tests: a single-node Ceph cluster on 127.0.0.1, started from
the Debian packages (``ceph-mon ceph-osd radosgw ceph-common``, Ceph 16.2.15; ``make
system-deps`` installs them) in a temporary folder, with the same surface as
:class:`tests.s3_server.MotoS3`::

    from tests.rgw_server import CephRGW, RGWUnavailable
    with CephRGW() as s3:           # ~20 s; raises RGWUnavailable saying why it could not
        s3.endpoint_url, s3.bucket, s3.client, s3.env

Why a real server next to moto: moto is a model of S3 written from its documentation, and
real S3-compatible servers differ from it in ways only a real one shows (an empty
CompleteMultipartUpload ETag, ``If-Match`` compared unquoted, 412 on a missing key, a minimum
part size enforced at completion). The cluster is the smallest that behaves like a real one:

- one monitor (msgr2 on a free loopback port), one bluestore OSD on a *sparse* block file of
  bounded size (``bluestore_block_size``, default 2 GiB: a few hundred MB are really written),
  pools of size 1 with 8 placement groups, cephx everywhere, no manager (nothing here needs
  one; the health warning it causes is harmless);
- one ``radosgw`` (beast frontend on a free loopback port) with ``rgw multipart min part
  size`` lowered to :data:`tests.s3_server.SMALL_PART`, so multipart tests need megabytes, and
  a short garbage-collection delay, so overwritten and deleted objects give their space back;
- one S3 user whose keys are the suite's dummy credentials (:data:`tests.s3_server.DUMMY_ENV`),
  so moto and RGW can serve the same test session, and no real credential is ever used.

Every daemon is started daemonised with a pid file in the temporary folder and stopped by
that pid file (SIGTERM, then SIGKILL) at exit, also when the start fails half-way; the
folder (block file included) is removed afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3

from tests.s3_server import DUMMY_ENV, SMALL_PART, BucketInspection, dummy_env, free_port

#: the Ceph binaries the cluster needs (Debian: ceph-mon, ceph-osd, radosgw, ceph-common)
BINARIES = ("ceph", "ceph-authtool", "monmaptool", "ceph-mon", "ceph-osd", "radosgw",
            "radosgw-admin")
#: seconds any one start-up step may take before the cluster counts as not starting: a
#: safety net for a broken installation, not a measure of speed (keep it generous)
STEP_TIMEOUT = 180.0


class RGWUnavailable(RuntimeError):
    """The Ceph packages are missing or the cluster could not start (the message says which
    and why); tests needing RGW are skipped with it."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class CephRGW(BucketInspection):
    """Context manager: a single-node Ceph cluster with one RGW on loopback, one bucket.

    ``block_gib`` bounds the OSD's sparse block file; ``min_part_size`` is RGW's minimum
    multipart part size (RGW refuses smaller parts at completion, ``EntityTooSmall``)."""

    kind = "rgw"

    def __init__(self, bucket: str = "mithril-test", *, block_gib: float = 2.0,
                 min_part_size: int = SMALL_PART) -> None:
        self.bucket = bucket
        self.block_gib = block_gib
        self.min_part_size = min_part_size
        self.mon_port = free_port()
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.fsid = str(uuid.uuid4())
        self.dir: Path | None = None
        self.client: Any = None
        self.version = ""
        self._env = contextlib.ExitStack()
        #: pids of the daemons stopped at exit (tests check none is left running)
        self.stopped: list[int] = []

    # -- start and stop --------------------------------------------------------------------
    def __enter__(self) -> CephRGW:
        missing = missing_binaries()
        if missing:
            raise RGWUnavailable(
                f"Ceph is not installed (missing {', '.join(missing)}): run `make system-deps` "
                "as root, or apt-get install ceph-mon ceph-osd radosgw ceph-common")
        self._env.enter_context(dummy_env())
        self.dir = Path(tempfile.mkdtemp(prefix="mithril-rgw-"))
        try:
            self._start()
        except BaseException as exc:
            log = self._log_tail()
            self.__exit__()
            if isinstance(exc, RGWUnavailable | subprocess.SubprocessError | OSError):
                raise RGWUnavailable(f"Ceph RGW did not start: {exc}{log}") from exc
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dir is not None:
            for name in ("client.rgw.a", "osd.0", "mon.a"):  # the reverse of the start order
                self._stop(self.dir / "run" / f"{name}.pid")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self._env.close()

    def _stop(self, pid_file: Path) -> None:
        """Stop the daemon whose pid ``pid_file`` holds: SIGTERM, then SIGKILL."""
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        self.stopped.append(pid)
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.05)

    def _conf(self) -> str:
        d = self.dir
        assert d is not None
        return f"""[global]
fsid = {self.fsid}
mon host = [v2:127.0.0.1:{self.mon_port}]
mon initial members = a
public network = 127.0.0.0/8
ms bind ipv6 = false
ms bind msgr1 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {d}/admin.keyring
run dir = {d}/run
pid file = {d}/run/$name.pid
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
log to stderr = false
err to stderr = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
[mon]
mon data = {d}/mon/$cluster-$id
[osd]
osd data = {d}/osd/$cluster-$id
keyring = {d}/osd/$cluster-$id/keyring
osd objectstore = bluestore
bluestore block size = {int(self.block_gib * (1 << 30))}
bluestore block create = true
bluestore fsck on mount = false
bluestore fsck on mkfs = false
osd memory target = 1073741824
osd max object size = 134217728
[client.rgw.a]
keyring = {d}/rgw.keyring
rgw data = {d}/rgw
rgw frontends = beast endpoint=127.0.0.1:{self.port}
rgw multipart min part size = {self.min_part_size}
rgw gc obj min wait = 10
rgw gc processor period = 10
rgw enable usage log = false
rgw dns name = 127.0.0.1
"""

    def _run(self, *args: str, input: str | None = None) -> str:
        conf = str(self._path("ceph.conf"))
        cmd = [args[0], "-c", conf, *args[1:]] if args[0] != "ceph-authtool" else list(args)
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input,
                              timeout=STEP_TIMEOUT, check=False)
        if proc.returncode != 0:
            raise RGWUnavailable(
                f"`{' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
        return proc.stdout

    def _path(self, name: str) -> Path:
        assert self.dir is not None
        return self.dir / name

    def _start(self) -> None:
        d = self._path("")
        for sub in ("run", "log", "mon", "osd/ceph-0", "rgw"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self._path("ceph.conf").write_text(self._conf())
        mon_keyring, admin = str(d / "mon.keyring"), str(d / "admin.keyring")
        self._run("ceph-authtool", "--create-keyring", mon_keyring, "--gen-key", "-n", "mon.",
                  "--cap", "mon", "allow *")
        self._run("ceph-authtool", "--create-keyring", admin, "--gen-key", "-n",
                  "client.admin", "--cap", "mon", "allow *", "--cap", "osd", "allow *",
                  "--cap", "mgr", "allow *")
        self._run("ceph-authtool", mon_keyring, "--import-keyring", admin)
        monmap = str(d / "monmap")
        self._run("monmaptool", "--create", "--addv", "a",
                  f"[v2:127.0.0.1:{self.mon_port}]", "--fsid", self.fsid, monmap)
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", mon_keyring)
        self._run("ceph-mon", "-i", "a")
        self._wait(lambda: self._ceph_json("mon", "stat") is not None, "the monitor")
        self.version = self._run("ceph", "--version").strip()
        # one bluestore OSD on a bounded sparse block file
        osd_uuid = str(uuid.uuid4())
        secret = self._run("ceph-authtool", "--gen-print-key").strip()
        osd_id = self._run("ceph", "osd", "new", osd_uuid, "-i", "-",
                           input=json.dumps({"cephx_secret": secret})).strip()
        if osd_id != "0":
            raise RGWUnavailable(f"`ceph osd new` gave id {osd_id!r}, expected 0")
        (d / "osd/ceph-0/keyring").write_text(f"[osd.0]\n\tkey = {secret}\n")
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._run("ceph-osd", "-i", "0")
        self._wait(self._osd_up, "the OSD")
        # the gateway and its user
        self._run("ceph", "auth", "get-or-create", "client.rgw.a", "mon", "allow rw",
                  "osd", "allow rwx", "-o", str(d / "rgw.keyring"))
        self._run("radosgw", "-n", "client.rgw.a")
        self._wait(self._http_up, "radosgw")
        self._run("radosgw-admin", "user", "create", "--uid", "mithril", "--display-name",
                  "mithril tests", "--access-key", DUMMY_ENV["AWS_ACCESS_KEY_ID"],
                  "--secret-key", DUMMY_ENV["AWS_SECRET_ACCESS_KEY"])
        self.client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")
        self._wait(self._make_bucket, "the bucket")

    def _ceph_json(self, *args: str) -> Any:
        try:
            out = self._run("ceph", *args, "--format", "json", "--connect-timeout", "10")
        except (RGWUnavailable, subprocess.TimeoutExpired):
            return None
        return json.loads(out)

    def _osd_up(self) -> bool:
        stat = self._ceph_json("osd", "stat")
        return bool(stat) and int(stat.get("num_up_osds", 0)) >= 1

    def _http_up(self) -> bool:
        import socket

        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
            return True
        return False

    def _make_bucket(self) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            return code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists")
        except BotoCoreError:
            return False
        return True

    def _wait(self, ready: Any, what: str) -> None:
        """Poll ``ready()`` until it holds; a daemon that died meanwhile fails at once."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while not ready():
            for pid_file in self._path("run").glob("*.pid"):
                with contextlib.suppress(OSError, ValueError):
                    if not _alive(int(pid_file.read_text().strip())):
                        raise RGWUnavailable(f"{pid_file.stem} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise RGWUnavailable(f"{what} not ready within {STEP_TIMEOUT:.0f} s")
            time.sleep(0.2)

    def _log_tail(self) -> str:
        """The last lines of each daemon's log, for the reason a start failed."""
        if self.dir is None:
            return ""
        parts = []
        for log in sorted((self.dir / "log").glob("*.log")):
            with contextlib.suppress(OSError):
                lines = log.read_text(errors="replace").splitlines()[-5:]
                parts.append(f"\n--- {log.name}:\n" + "\n".join(lines))
        return "".join(parts)


_shared: CephRGW | RGWUnavailable | None = None


def shared_rgw() -> CephRGW:
    """The one RGW of this test process: started on the first call (~20 s), stopped when the
    process exits, so the storage and the fault tests share it, as one session-scoped
    fixture would. A start that failed is not retried: every later call raises the same
    :class:`RGWUnavailable`, so each test needing RGW is skipped with the reason at once.

    Callers keep :func:`tests.s3_server.dummy_env` in force while they use it (a moto
    server stopping meanwhile restores the environment it found)."""
    global _shared
    if _shared is None:
        rgw = CephRGW()
        try:
            rgw.__enter__()
        except RGWUnavailable as exc:
            _shared = exc
        else:
            _shared = rgw
            owner = os.getpid()  # a forked child inherits the handler: only we stop it

            def stop() -> None:
                if os.getpid() == owner:
                    rgw.__exit__()

            atexit.register(stop)
    if isinstance(_shared, RGWUnavailable):
        raise _shared
    return _shared


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, i.e. exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


if __name__ == "__main__":  # python -m tests.rgw_server: start, show, wait for Ctrl-C
    started = time.monotonic()
    with CephRGW() as rgw:
        print(f"{rgw.version}: RGW at {rgw.endpoint_url}, bucket {rgw.bucket}, "
              f"up in {time.monotonic() - started:.1f} s (Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
