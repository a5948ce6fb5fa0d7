"""Version claims: who reserved a version number, and when that reservation is abandoned.

A version number is reserved by a claim file that says who owns it (host, boot id, PID
namespace, pid, a random token) and when its owner was last alive (a heartbeat the writer
renews while its save runs). Other processes share the run (a restarted job, ``mithril gc``,
containers with one hostname but separate PID namespaces), so a claim is abandoned ("stale")
only when its heartbeat has stopped for ``claim_stale_s``, or when its owner is provably dead:
same boot and same PID namespace, and no such pid. A pid alone proves nothing across
namespaces: taking it for one would delete live saves.

Pure rules over parsed claim documents; :class:`~mithril_async.catalog.RunCatalog` reads and
writes them in the store.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["CLAIM_STALE_S", "MAX_HEARTBEAT_S", "Claim", "claim_doc_stale", "claim_token",
           "describe_claim", "heartbeat_interval", "owner_identity", "process_start"]

#: an unfinished version whose claim's heartbeat is older than this is abandoned and may be
#: cleaned (the default of ``[checkpointing.pipeline] claim_stale_s``)
CLAIM_STALE_S = 300.0
#: the longest pause between two heartbeats of a live claim
MAX_HEARTBEAT_S = 30.0


def heartbeat_interval(stale_after_s: float) -> float:
    """How often a live writer renews its claim: four beats fit in the staleness bound, so a
    late beat or two (a loaded machine, a slow store) never makes a live claim look stale."""
    return max(0.01, min(MAX_HEARTBEAT_S, stale_after_s / 4))


def owner_identity() -> dict[str, Any]:
    """Who this process is, as a claim records it: hostname, boot id, PID-namespace id, pid.

    Boot id and namespace id tell whether a claim's pid can be checked here at all: a pid
    means nothing in another PID namespace (containers sharing a hostname) or after a
    reboot. Either is None where /proc does not provide it (then no pid is ever trusted)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot: str | None = f.read().strip() or None
    except OSError:
        boot = None
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns, "pid": os.getpid()}


def _beat(doc: dict[str, Any]) -> float | None:
    """The claim's last sign of life: its heartbeat, or its creation time (older claims)."""
    times = [v for v in (doc.get("hb"), doc.get("t"))
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return max(times) if times else None


def _same_pid_namespace(doc: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the claim's pid can be checked from here: same boot, same PID namespace."""
    return (me["boot"] is not None and me["pidns"] is not None
            and doc.get("boot") == me["boot"] and doc.get("pidns") == me["pidns"])


def claim_doc_stale(doc: object, stale_after_s: float, *, now: float | None = None,
                    me: dict[str, Any] | None = None) -> bool:
    """Whether a claim (its parsed ``_claim.json``) is abandoned.

    Garbage or no time at all: abandoned. Owner in this boot and PID namespace: this very
    process's claim is never abandoned to itself (another manager of the process may be
    saving), one whose pid is gone, a zombie, or another process than the one that started at
    the claim's ``start`` is (provably dead). Otherwise only a heartbeat older than
    ``stale_after_s`` makes it abandoned; a pid that is not alive here proves nothing about
    another namespace.
    """
    if not isinstance(doc, dict):
        return True
    beat = _beat(doc)
    if beat is None:
        return True
    me = me if me is not None else owner_identity()
    pid = doc.get("pid")
    if _same_pid_namespace(doc, me) and isinstance(pid, int) and not isinstance(pid, bool):
        start = doc.get("start")
        start = start if isinstance(start, int) and not isinstance(start, bool) else None
        if pid == me["pid"]:  # ours, unless an earlier process had our pid
            return start is not None and start != process_start(pid)
        if not _pid_alive(pid, start):
            return True
    return (time.time() if now is None else now) - beat > stale_after_s


def claim_token(doc: object) -> str | None:
    """The owner token of a parsed claim; None for no claim, garbage or a claim without one.

    A writer's claim always carries a token (it is written whole, atomically), so None names
    only what no writer owns: a missing claim or one that is not a writer's."""
    token = doc.get("token") if isinstance(doc, dict) else None
    return token if isinstance(token, str) else None


def describe_claim(doc: object, *, now: float | None = None) -> str:
    """A claim's owner and heartbeat age in words (``mithril gc`` says why it skips one)."""
    if not isinstance(doc, dict):
        return "no readable claim"
    me = owner_identity()
    where = "this PID namespace" if _same_pid_namespace(doc, me) else "another PID namespace"
    beat = _beat(doc)
    age = "no heartbeat" if beat is None else \
        f"heartbeat {max(0.0, (time.time() if now is None else now) - beat):.0f} s ago"
    return f"pid {doc.get('pid')} on host {doc.get('host')} ({where}), {age}"


@dataclass
class Claim:
    """A version number this process reserved, and what proves the claim is still its own."""

    number: int
    #: the claim file's content as written (``token`` identifies the owner)
    doc: dict[str, Any]
    #: set when a renewal found the claim removed or replaced: the save must not commit
    lost: bool = False
    #: why the claim was lost, for the error the save raises
    reason: str = ""

    @property
    def token(self) -> str:
        return str(self.doc["token"])


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22):
    with the pid, it names one process, so a pid reused after its owner died is told apart.
    None where /proc cannot say."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of ``pid`` from /proc; None if unreadable or no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` is a running process of this namespace (and, given ``start``, the one
    that started then): a zombie (killed, not yet reaped by its parent) is dead, and so is
    a pid reused by another process."""
    if os.path.isdir(f"/proc/{os.getpid()}"):
        stat = _proc_stat(pid)
        if stat is None:
            return os.path.exists(f"/proc/{pid}")  # vanished meanwhile, or unreadable
        state, started = stat
        return state not in ("Z", "X", "x") and (start is None or started == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
