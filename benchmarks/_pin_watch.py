"""A watcher process for bench_interference.py: CPU placement and memory of a process tree.

``python benchmarks/_pin_watch.py --pid P --keep TID`` polls ``/proc/P/task/*`` (and the tasks
of every descendant process of P: a checkpoint worker, DCP's save process) every few ms:

* placement "pinned": thread TID (the training thread) on CPU 0, every other thread of the
  tree on CPU 1, re-applied to each new thread as it appears (a thread or process inherits
  the affinity of the thread that created it, so the training thread's children would
  otherwise start on its core). Placement "free": every thread on both CPUs. The watcher runs
  on CPU 1 itself.
* memory: each process's RSS (``/proc/<pid>/status``) and its peak since the last ``mark``,
  and the peak of the tree's combined RSS: the training process's RSS plus each other
  process's anonymous RSS (``RssAnon``). The rest of a child's RSS is shared with the
  training process: the shared memory it maps is the training process's staging, and its
  file pages are mostly the same libraries (torch) the training process maps, one copy in
  the page cache; so each physical page is counted once.

Commands, one per line on stdin, each answered by one line on stdout: ``mark`` (peaks start
from now; answers ``ok``), ``peak`` (a JSON object, see :meth:`Watcher.peaks`), ``place
pinned|free`` (answers ``ok`` once every thread was placed), ``quit``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
from typing import Any

#: re-read which processes belong to the tree every this many passes (threads: every pass)
TREE_EVERY = 8


def _read_status(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, RSS, anonymous RSS in bytes) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    ppid = rss = anon = 0
    for line in text.split(b"\n"):
        if line.startswith(b"PPid:"):
            ppid = int(line.split()[1])
        elif line.startswith(b"VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith(b"RssAnon:"):
            anon = int(line.split()[1]) * 1024
    return ppid, rss, anon


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in _tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


class Watcher:
    """Placement and memory peaks of the tree rooted at ``root`` (see the module doc)."""

    def __init__(self, root: int, keep: int, train_cpu: int, other_cpu: int) -> None:
        self.root = root
        self.keep = keep
        self.train_cpu = train_cpu
        self.other_cpu = other_cpu
        self.mode = "pinned"
        self.me = os.getpid()
        self.pids: list[int] = [root]
        self.placed: set[tuple[int, int]] = set()  # (pid, tid) already placed in this mode
        self.passes = 0
        self.before: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.combined_peak = self.combined_now = self.combined_before = 0
        self.mark()

    def _tree(self) -> list[int]:
        seen, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            if pid in seen or pid == self.me:
                continue
            seen.append(pid)
            todo += _children(pid)
        return seen

    def _cpus(self, tid: int) -> set[int]:
        both = {self.train_cpu, self.other_cpu}
        if self.mode == "free":
            return both
        return {self.train_cpu} if tid == self.keep else {self.other_cpu}

    def place(self) -> None:
        """Give every not yet placed thread of the tree its CPUs."""
        for pid in self.pids:
            for tid in _tasks(pid):
                if (pid, tid) in self.placed:
                    continue
                with contextlib.suppress(OSError):  # it ended meanwhile
                    os.sched_setaffinity(tid, self._cpus(tid))
                self.placed.add((pid, tid))

    def sample(self) -> None:
        combined = 0
        self.now: dict[int, tuple[int, int, int]] = {}
        tree = set(self.pids)
        for pid in self.pids:
            got = _read_status(pid)
            if got is None:
                continue
            ppid, rss, anon = got
            if pid != self.root and ppid not in tree:  # it ended, and its pid was reused
                continue
            self.now[pid] = (ppid, rss, anon)
            self.before.setdefault(pid, rss)
            self.peak[pid] = max(self.peak.get(pid, 0), rss)
            combined += rss if pid == self.root else anon
        self.combined_peak = max(self.combined_peak, combined)
        self.combined_now = combined

    def mark(self) -> None:
        self.before, self.peak = {}, {}
        self.combined_peak = self.combined_now = 0
        self.sample()
        self.combined_before = self.combined_now

    def peaks(self) -> dict[str, Any]:
        """Since the last mark: per pid its RSS at the mark (or when first seen) and its
        peak; the tree's combined RSS at the mark, its peak, and now (bytes)."""
        self.sample()
        return {"pids": {str(p): {"before": self.before[p], "peak": self.peak[p]}
                         for p in self.peak},
                "combined_before": self.combined_before,
                "combined_peak": self.combined_peak, "combined_now": self.combined_now,
                "now": {str(p): v for p, v in self.now.items()}}

    def step(self) -> None:
        if self.passes % TREE_EVERY == 0:
            self.pids = self._tree()
        self.passes += 1
        self.place()
        self.sample()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int, required=True, help="the benchmark process")
    ap.add_argument("--keep", type=int, required=True, help="the training thread's tid")
    ap.add_argument("--train-cpu", type=int, default=0)
    ap.add_argument("--other-cpu", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.003, help="seconds between passes")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.other_cpu})
    w = Watcher(args.pid, args.keep, args.train_cpu, args.other_cpu)
    w.step()
    print("ready", flush=True)
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], args.interval)
        if ready:
            line = stdin.readline().decode().strip()
            if not line or line == "quit":
                return
            cmd, _, arg = line.partition(" ")
            if cmd == "mark":
                w.mark()
                out: Any = "ok"
            elif cmd == "peak":
                out = json.dumps(w.peaks())
            elif cmd == "place" and arg in ("pinned", "free"):
                w.mode, w.placed = arg, set()
                w.pids = w._tree()
                w.place()
                out = "ok"
            else:
                out = json.dumps({"error": f"unknown command {line!r}"})
            print(out, flush=True)
        if not os.path.exists(f"/proc/{args.pid}"):
            return
        w.step()


if __name__ == "__main__":
    main()
