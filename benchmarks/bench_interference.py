"""How much a background save costs a training thread, and how much a busy training thread
stretches the save: ours with the checkpoint worker process, ours inline (threads of the
training process), DCP ``async_save`` in thread mode and in process mode, and
torch_checkpointing (its ``CheckpointManager``: a staging thread of the training process
copies the state into shared memory, one writer process writes it; skipped, with the reason
printed, where it is not installed), side by side in one run.

Set-up (2 cores): the training thread runs alone on CPU 0; every other thread of this process
and of its child processes (our checkpoint worker, DCP's save process) runs on CPU 1, moved
there by a watcher process (``_pin_watch.py``) that polls ``/proc`` every few ms and places
each new thread as it appears; so no core is shared, and the only way a save slows the
training thread is the GIL (and the caches and memory bandwidth the two cores share). The
state lives on tmpfs (``/dev/shm``), so no disk plays a part; each checkpoint is deleted right
after it is measured. The state: ``--gib`` of bf16 weights plus two fp32 AdamW moments
(2 + 4 + 4 bytes a parameter), saved with each system's default configuration (ours:
compression on, every codec thread; DCP: its default stager and file system writer;
torch_checkpointing: the CPU staging configuration of its troubleshooting guide, its staging
buffers prewarmed with ``prewarm_staging`` when the system is made).

Two kinds of training step run on the training thread:

* ``python``: a pure-Python, cache-resident loop of dict and list operations (~1.5 ms a step;
  it stands in for an eager GPU loop's kernel-launching thread, busy in Python most of the
  time: only the GIL can slow it);
* ``torch``: a small MLP's forward, backward and AdamW step on one thread
  (``torch.set_num_threads(1)``; dispatcher-bound).

Per system, per round: a warm-up save (buffers, worker start: its end-to-end time is "e2e
first"), a save with training idle (the training thread waits for it), a save with training
busy (the thread steps throughout), and a save for memory (training idle). Per save:

* blocked: how long the save call took;
* staged idle: from the call until the state may change again (training idle): the same as
  blocked idle but for torch_checkpointing, whose ``save()`` returns before its staging thread
  copied the state; its ``manager.lock()`` (the guard around ``optimizer.step()``) waits for
  the copy. The steps here never change the saved state, so none of them takes that lock;
* GIL wait: while the save was in flight after the call returned, the training thread's wall
  time minus its own CPU time (``time.thread_time()``) minus ``runq``, the time the kernel
  counts as runnable but waiting for a CPU (``/proc/self/task/<tid>/schedstat``). Alone on
  its core, the thread is off it only asleep, waiting for the GIL, or runnable behind another
  process on that core: on a shared machine other users' processes cause ``runq``, on a quiet
  one it is ~0 and GIL wait = wall - thread time;
* lost = blocked (its run-queue waits left out) + GIL wait: what the save cost the training
  thread ("lost incl. runq": blocked + wall - thread time, the run-queue waits included);
* slowdown: the mean step time (run-queue waits left out) while the save was in flight / the
  same just before it (``step CPU``: the same ratio for the step's CPU time: cache and
  memory-bandwidth interference, not waiting);
* e2e busy / idle: from the call to the durable checkpoint, with training busy / idle;
  stretch = busy / idle;
* RSS (the memory save, after ``malloc_trim`` so that freed heap memory is not reused
  unseen): peak extra resident memory above what it was just before the save, of the
  training process, of the child process (worker, DCP's save process), and of the tree
  combined (the training process's RSS plus each child's anonymous RSS: the staging memory a
  child maps and the library pages both map are counted once); "held": what the system
  keeps between saves (staging buffers, a worker process), the tree's RSS before the memory
  save minus before the system was made; "peak" = held + extra: its whole memory cost.

Then the knobs (torch step, ours with the worker): ``background_nice`` 0 vs 10 and codec
``threads`` default vs 1, with the training thread pinned as above and with every thread free
to run on both cores (where nice matters: the save's threads then compete for the training
thread's core).

Medians of ``--rounds`` rounds (the order of the systems rotates each round); every run is
printed too.

    python benchmarks/bench_interference.py [--rounds 3] [--gib 0.5] [--quick]
                                            [--parts main,knobs] [--json out.json]
                                            [--systems "ours worker,torch_checkpointing"]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import functools
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _tc

from mithril_async import CheckpointManager, TensorDict, parse_config

if __name__ == "__mp_main__":  # DCP's save process (spawned: it imports this module)
    from torch.distributed.checkpoint import _async_process_executor

    # it logs every request at INFO on stderr; only warnings and errors here
    _async_process_executor._init_logger = lambda rank: None

HERE = Path(__file__).resolve().parent
Tensors = dict[str, torch.Tensor]
Row = dict[str, Any]

#: the systems of the main table, in print order
MAIN = ("ours worker", "ours inline", "DCP thread", "DCP process", _tc.NAME)
#: the systems the targets compare (the DCP targets need all of them)
TARGETS = MAIN[:4]
#: the memory a run needs at its peak, in state sizes (see check_memory)
NEEDS_X = 5
#: the knob configurations (ours, worker): (background_nice, codec threads; None = default)
KNOBS = ((0, None), (10, None), (0, 1), (10, 1))


# ---------------------------------------------------------------------------- the state
def make_state(gib: float) -> tuple[Tensors, Tensors]:
    """bf16 weights and fp32 AdamW moments (exp_avg, exp_avg_sq) of ``gib`` GiB in all."""
    params = int(gib * (1 << 30)) // 10 // 1024 * 1024
    per = 1 << 22
    g = torch.Generator().manual_seed(0)
    weights: Tensors = {}
    moments: Tensors = {}
    i = 0
    while params > 0:
        n = min(per, params)
        shape = (n // 1024, 1024)
        weights[f"layer{i}.weight"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        grad = torch.randn(shape, generator=g) * 1e-3
        moments[f"layer{i}.exp_avg"] = grad * 0.1
        moments[f"layer{i}.exp_avg_sq"] = grad.square() * 1e-3
        params -= n
        i += 1
    return weights, moments


def nbytes(*dicts: Tensors) -> int:
    return sum(t.numel() * t.element_size() for d in dicts for t in d.values())


# ---------------------------------------------------------------------------- the steps
class PythonStep:
    """A pure-Python, cache-resident step: dict and list updates, no allocation that grows."""

    def __init__(self, target_s: float) -> None:
        self.d = {i: i for i in range(512)}
        self.lst = list(range(512))
        self.n = 1000
        for _ in range(3):  # calibrate the loop length to about target_s a step
            t = time.perf_counter()
            for _ in range(20):
                self()
            took = (time.perf_counter() - t) / 20
            self.n = max(100, int(self.n * target_s / took))

    def __call__(self) -> None:
        d, lst = self.d, self.lst
        s = 0
        for i in range(self.n):
            k = i & 511
            v = d[k] + lst[k]
            d[k] = v & 0xFFFF
            lst[k] = v >> 1
            s += v


class TorchStep:
    """A small MLP's training step (forward, backward, AdamW) on one thread."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
            torch.nn.GELU(), torch.nn.Linear(256, 128))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(32, 128)
        self.y = torch.randn(32, 128)

    def __call__(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


# ---------------------------------------------------------------------------- the systems
class System:
    """One way to save the state in the background; ``start`` returns once the save call
    returned, with a future that resolves when the checkpoint is durable."""

    name = ""

    def start(self, step: int) -> concurrent.futures.Future[Any]:
        raise NotImplementedError

    def wait_staged(self) -> None:
        """Return once the save in flight no longer reads the live state (most systems
        copied it before ``start`` returned)."""

    def drop(self, step: int) -> None:
        """Delete what the save of ``step`` wrote (tmpfs is memory)."""

    def child_pid(self) -> int | None:
        return None

    def close(self) -> None:
        """Release everything (files included)."""


class Ours(System):
    def __init__(self, name: str, root: Path, state: dict[str, Any], process: str,
                 nice: int = 0, threads: int | None = None) -> None:
        self.name, self.root = name, root
        toml = (f'[checkpointing]\nruns_path = "{root}"\nrun_id = "bench"\n'
                f'[checkpointing.pipeline]\nprocess = "{process}"\n'
                + (f"background_nice = {nice}\n" if nice else "")
                + (f"[checkpointing.compression]\nthreads = {threads}\n" if threads else ""))
        self.manager = CheckpointManager(parse_config(toml), state)
        if self.manager.process != process:
            raise SystemExit(f"{name}: the manager runs saves {self.manager.process}, "
                             f"not {process}")

    def start(self, step: int) -> concurrent.futures.Future[Any]:
        handle = self.manager.save_nowait(step)
        assert handle.future is not None
        return handle.future

    def drop(self, step: int) -> None:
        # the blobs go; the small manifest and claim stay, so version numbering is untouched
        for f in (self.root / "bench" / "versions").glob("v*/*"):
            if f.suffix in (".mckp", ".bin", ".safetensors"):
                f.unlink()

    def child_pid(self) -> int | None:
        return self.manager.worker_pid

    def close(self) -> None:
        self.manager.close()
        shutil.rmtree(self.root, ignore_errors=True)


class Dcp(System):
    def __init__(self, name: str, root: Path, sd: dict[str, Tensors], process: bool) -> None:
        self.name, self.root, self.sd = name, root, sd
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD

    def start(self, step: int) -> concurrent.futures.Future[Any]:
        fut: Any = dcp.async_save(self.sd, checkpoint_id=str(self.root / f"s{step}"),
                                  async_checkpointer_type=self.kind)
        return fut

    def drop(self, step: int) -> None:
        shutil.rmtree(self.root / f"s{step}", ignore_errors=True)

    def child_pid(self) -> int | None:
        if self.kind != AsyncCheckpointerType.PROCESS:
            return None
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = ape._CHECKPOINT_PROCESS
        return None if proc is None else proc._save_process.pid

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class TorchCheckpointing(System):
    """torch_checkpointing's async save (``benchmarks/_tc.py``), staging prewarmed."""

    def __init__(self, name: str, root: Path, sd: dict[str, Tensors]) -> None:
        self.name, self.root, self.sd = name, root, sd
        self.tc = _tc.Tc()
        self.tc.prewarm(sd)

    def start(self, step: int) -> concurrent.futures.Future[Any]:
        return self.tc.save(self.root / f"s{step}", self.sd)

    def wait_staged(self) -> None:
        self.tc.wait_staged()

    def drop(self, step: int) -> None:
        shutil.rmtree(self.root / f"s{step}", ignore_errors=True)

    def child_pid(self) -> int | None:
        return self.tc.writer_pid()

    def close(self) -> None:
        self.tc.close()
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------- measuring
class Watch:
    """The watcher process (``_pin_watch.py``): placement and memory peaks of our tree."""

    def __init__(self, tid: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_pin_watch.py"), "--pid", str(os.getpid()),
             "--keep", str(tid)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the watcher process ended")
        return line.strip()

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def mark(self) -> None:
        self.ask("mark")

    def peaks(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.ask("peak"))
        return out

    def place(self, mode: str) -> None:
        self.ask(f"place {mode}")

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(5)


class Clock:
    """The training thread's wall time, CPU time and run-queue wait, read together."""

    def __init__(self) -> None:
        self.schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"

    def now(self) -> tuple[float, float, float]:
        with open(self.schedstat, "rb") as f:
            runq = int(f.read().split()[1]) / 1e9
        return time.perf_counter(), time.thread_time(), runq


class Trainer:
    """Runs on the training thread: steps, and saves measured against them."""

    def __init__(self, step: Callable[[], None], watch: Watch, idle_s: float) -> None:
        self.step = step
        self.watch = watch
        self.idle_s = idle_s
        self.clock = Clock()

    def steps_for(self, seconds: float) -> dict[str, float]:
        """Step for ``seconds``: a step's mean wall time, the same without run-queue waits,
        its mean CPU time; the fractions of the wall time spent off the core and waiting in
        the run queue."""
        a = self.clock.now()
        n = 0
        while time.perf_counter() - a[0] < seconds:
            self.step()
            n += 1
        b = self.clock.now()
        wall, cpu, runq = (b[0] - a[0]), (b[1] - a[1]), (b[2] - a[2])
        return {"step_s": wall / n, "step_own_s": (wall - runq) / n, "cpu_s": cpu / n,
                "off_rate": (wall - cpu) / wall, "runq_rate": runq / wall}

    def idle_save(self, system: System, step: int) -> Row:
        """A save while the training thread waits for it."""
        a = self.clock.now()
        fut = system.start(step)
        b = self.clock.now()
        done = _finish_time(fut)
        system.wait_staged()
        staged = time.perf_counter()
        fut.result()
        while "t" not in done:  # the callback runs right after the result is set
            time.sleep(0.0005)
        system.drop(step)
        return {"blocked_idle_s": b[0] - a[0], "blocked_idle_own_s": b[0] - a[0] - (b[2] - a[2]),
                "staged_idle_s": staged - a[0], "e2e_idle_s": done["t"] - a[0]}

    def busy_save(self, system: System, step: int) -> Row:
        """A save while the training thread steps (after ``idle_s`` of steps without one)."""
        base = self.steps_for(self.idle_s)
        a = self.clock.now()
        fut = system.start(step)
        b = self.clock.now()
        done = _finish_time(fut)
        n = 0
        while "t" not in done:
            self.step()
            n += 1
        c = self.clock.now()
        fut.result()
        system.drop(step)
        wall, cpu, runq = c[0] - b[0], c[1] - b[1], c[2] - b[2]
        blocked, blocked_own = b[0] - a[0], b[0] - a[0] - (b[2] - a[2])
        n = max(n, 1)
        waited = wall - cpu - runq  # asleep: waiting for the GIL
        return {"blocked_s": blocked, "blocked_own_s": blocked_own, "gil_s": waited,
                "runq_s": runq, "lost_s": blocked_own + waited,
                "lost_raw_s": blocked + wall - cpu, "e2e_busy_s": done["t"] - a[0], "steps": n,
                "step_idle_s": base["step_s"], "step_busy_s": wall / n,
                "slowdown": ((wall - runq) / n) / base["step_own_s"],
                "slowdown_raw": (wall / n) / base["step_s"],
                "cpu_x": (cpu / n) / base["cpu_s"],
                "idle_off_rate": base["off_rate"], "idle_runq_rate": base["runq_rate"]}

    def memory_save(self, system: System, step: int) -> Row:
        """A save while the training thread waits, for its memory: freed heap memory is
        handed back first (``malloc_trim``), so what a save allocates shows in the RSS
        instead of reusing what an earlier save freed."""
        trim()
        self.watch.mark()
        self.idle_save(system, step)
        got = self.watch.peaks()
        pids, child = got["pids"], system.child_pid()
        mine = pids.get(str(os.getpid()), {"before": 0, "peak": 0})
        other = pids.get(str(child)) if child is not None else None
        return {"rss_train": (mine["peak"] - mine["before"]) / 2**20,
                "rss_child": (other["peak"] - other["before"]) / 2**20 if other else 0.0,
                "rss_all": (got["combined_peak"] - got["combined_before"]) / 2**20,
                "combined_before": got["combined_before"]}


def _finish_time(fut: concurrent.futures.Future[Any]) -> dict[str, float]:
    """``{"t": perf_counter()}`` once ``fut`` is done (set by its done callback)."""
    done: dict[str, float] = {}
    fut.add_done_callback(lambda _: done.setdefault("t", time.perf_counter()))
    return done


def trim() -> None:
    """Free what only reference cycles still hold, and hand the heap memory freed so far
    back to the system (glibc ``malloc_trim``)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---------------------------------------------------------------------------- the run
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_dist() -> None:
    """A single-rank gloo group: DCP's saves (process mode above all) need one."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)


def check_memory(gib: float, where: Path) -> None:
    """Refuse to start where the run could exhaust a shared machine's memory: the state, its
    staged copies, a worker and one checkpoint in tmpfs need about 5x the state at peak."""
    need = int(NEEDS_X * gib * (1 << 30))
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f
                     if line.startswith("MemAvailable:"))
    free = shutil.disk_usage(where).free
    if avail < need or free < need:
        raise SystemExit(f"needs about {need / 2**30:.1f} GiB of free memory and of free space "
                         f"in {where}; {avail / 2**30:.1f} GiB available, {free / 2**30:.1f} "
                         "GiB free there (other work on this machine?)")


def rotate(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def measure(trainer: Trainer, make: Callable[[], System], step0: int) -> Row:
    """One round of one system: a warm-up save, a save with training idle, one with training
    busy, and one for memory. ``rss_held``: what the system keeps between saves (staging
    buffers, a worker process): the tree's combined RSS before its memory save minus before
    it was made; ``rss_peak`` = held + the memory save's peak extra: its whole cost."""
    trim()
    base_doc = trainer.watch.peaks()
    base = base_doc["combined_now"]
    system = make()
    try:
        first = trainer.idle_save(system, step0)
        row = trainer.idle_save(system, step0 + 1)
        row["e2e_first_s"] = first["e2e_idle_s"]
        row.update(trainer.busy_save(system, step0 + 2))
        row.update(trainer.memory_save(system, step0 + 3))
    finally:
        system.close()
    row["rss_held"] = (row.pop("combined_before") - base) / 2**20
    row["rss_base"] = base_doc
    row["rss_peak"] = row["rss_held"] + row["rss_all"]
    row["e2e_stretch"] = row["e2e_busy_s"] / row["e2e_idle_s"]
    return row


class Systems:
    """Makes each named system over one state."""

    def __init__(self, gib: float) -> None:
        weights, moments = make_state(gib)
        self.state = {"model": TensorDict(weights), "optimizer": TensorDict(moments)}
        self.sd = {"model": weights, "optim": moments}
        self.what = (f"{nbytes(weights, moments) / 2**30:.3f} GiB ({len(weights)} bf16 "
                     f"weights, {len(moments)} fp32 moments)")
        #: the knob study's systems: name -> (background_nice, codec threads)
        self.knobs = {knob_name(n, t, pl): (n, t) for pl in ("pinned", "free") for n, t in KNOBS}

    def make(self, name: str, path: Path) -> System:
        if name == "ours worker":
            return Ours(name, path, self.state, "worker")
        if name == "ours inline":
            return Ours(name, path, self.state, "inline")
        if name in ("DCP thread", "DCP process"):
            return Dcp(name, path, self.sd, process=name == "DCP process")
        if name == _tc.NAME:
            return TorchCheckpointing(name, path, self.sd)
        nice, threads = self.knobs[name]
        return Ours(name, path, self.state, "worker", nice, threads)


def make_step(kind: str, step_ms: float) -> Callable[[], None]:
    return PythonStep(step_ms / 1e3) if kind == "python" else TorchStep()


def run_parts(args: argparse.Namespace, watch: Watch, root: Path) -> dict[str, Any]:
    systems = Systems(args.gib)
    print(f"state: {systems.what} on {root}", flush=True)
    runs: dict[str, dict[str, list[Row]]] = {}
    plan: list[tuple[str, str, list[str]]] = []
    if "main" in args.parts:
        plan += [(kind, kind, list(args.systems)) for kind in args.kinds]
    if "knobs" in args.parts:
        plan.append(("torch knobs", "torch", list(systems.knobs)))
    step_no = 0
    for title, kind, names in plan:
        trainer = Trainer(make_step(kind, args.step_ms), watch, args.idle_s)
        trainer.steps_for(0.3)  # warm
        table = runs.setdefault(title, {n: [] for n in names})
        for r in range(args.rounds):
            for name in rotate(names, r):
                watch.place("free" if name.endswith("free") else "pinned")
                path = root / f"{kind}-{r}-{name.replace(' ', '_').replace(',', '')}"
                row = measure(trainer, functools.partial(systems.make, name, path), step_no)
                step_no += 10
                row["round"] = r
                table[name].append(row)
                print(f"  {title:11} round {r} {name:26} " + brief(row), flush=True)
        watch.place("pinned")
    return runs


def knob_name(nice: int, threads: int | None, placement: str) -> str:
    return f"nice {nice}, threads {threads or 'all'}, {placement}"


def brief(row: Row) -> str:
    return (f"blocked {row['blocked_s'] * 1e3:6.1f} ms  lost {row['lost_s'] * 1e3:7.1f} ms "
            f"(GIL {row['gil_s'] * 1e3:7.1f}, runq {row['runq_s'] * 1e3:6.1f})  "
            f"slowdown {row['slowdown']:5.2f}x (cpu {row['cpu_x']:4.2f}x)  "
            f"e2e {row['e2e_busy_s']:6.2f} s busy / {row['e2e_idle_s']:5.2f} s idle "
            f"= {row['e2e_stretch']:5.2f}x  rss +{row['rss_train']:.0f} / "
            f"+{row['rss_child']:.0f} / +{row['rss_all']:.0f} MiB, held {row['rss_held']:.0f}"
            f", blocked idle {row['blocked_idle_s'] * 1e3:.0f} ms")


# ---------------------------------------------------------------------------- reporting
#: (header, row key, scale, format) of the two tables: what the save cost the training
#: thread, and what the save itself took
TRAINING = (("blocked ms", "blocked_s", 1e3, "{:.0f}"),
            ("GIL wait ms", "gil_s", 1e3, "{:.0f}"),
            ("lost ms", "lost_s", 1e3, "{:.0f}"), ("runq ms", "runq_s", 1e3, "{:.0f}"),
            ("lost incl. runq ms", "lost_raw_s", 1e3, "{:.0f}"),
            ("step idle ms", "step_idle_s", 1e3, "{:.2f}"),
            ("slowdown", "slowdown", 1, "{:.2f}x"),
            ("slowdown incl. runq", "slowdown_raw", 1, "{:.2f}x"),
            ("step CPU", "cpu_x", 1, "{:.2f}x"))
SAVE = (("blocked idle ms", "blocked_idle_s", 1e3, "{:.0f}"),
        ("staged idle ms", "staged_idle_s", 1e3, "{:.0f}"),
        ("e2e first s", "e2e_first_s", 1, "{:.2f}"),
        ("e2e busy s", "e2e_busy_s", 1, "{:.2f}"), ("e2e idle s", "e2e_idle_s", 1, "{:.2f}"),
        ("stretch", "e2e_stretch", 1, "{:.2f}x"),
        ("RSS+ train MiB", "rss_train", 1, "{:.0f}"),
        ("RSS+ child MiB", "rss_child", 1, "{:.0f}"),
        ("RSS+ all MiB", "rss_all", 1, "{:.0f}"),
        ("RSS held MiB", "rss_held", 1, "{:.0f}"),
        ("RSS peak MiB", "rss_peak", 1, "{:.0f}"))
Column = tuple[str, str, float, str]


def med(rows: list[Row], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(title: str, runs: dict[str, list[Row]], columns: tuple[Column, ...]
          ) -> Iterator[str]:
    yield f"\n{title} (medians of {max(len(v) for v in runs.values())} rounds)"
    yield "| system | " + " | ".join(c[0] for c in columns) + " |"
    yield "|---|" + "---:|" * len(columns)
    for name, rows in runs.items():
        yield (f"| {name} | " + " | ".join(fmt.format(med(rows, key) * scale)
                                          for _, key, scale, fmt in columns) + " |")


def every_run(title: str, runs: dict[str, list[Row]]) -> Iterator[str]:
    columns = TRAINING + SAVE
    yield f"\n{title}: every run"
    yield "| system | round | " + " | ".join(c[0] for c in columns) + " |"
    yield "|---|---:|" + "---:|" * len(columns)
    for name, rows in runs.items():
        for row in rows:
            yield (f"| {name} | {row['round']} | " + " | ".join(
                fmt.format(row[key] * scale) for _, key, scale, fmt in columns) + " |")


def verdicts(runs: dict[str, dict[str, list[Row]]]) -> Iterator[str]:
    """The issue's targets, each met or not, with the numbers."""
    def ok(flag: bool) -> str:
        return "met" if flag else "NOT met"

    yield "\nTargets:"
    for kind in ("python", "torch"):
        t = runs.get(kind)
        if t is not None and "ours worker" in t and _tc.NAME in t:
            yield from versus_tc(kind, t)
        if t is None or not all(n in t for n in TARGETS):
            continue
        w, i = t["ours worker"], t["ours inline"]
        best_dcp = min(("DCP thread", "DCP process"), key=lambda n: med(t[n], "lost_s"))
        lw, li, ld = med(w, "lost_s"), med(i, "lost_s"), med(t[best_dcp], "lost_s")
        if kind == "python":
            yield (f"- python step: lost per save, worker / best DCP ({best_dcp}) = "
                   f"{lw * 1e3:.0f} / {ld * 1e3:.0f} ms = {lw / ld:.2f}x (target <= 0.5x): "
                   f"{ok(lw / ld <= 0.5)}; inline: {li / ld:.2f}x")
            rw, rd = med(w, "lost_raw_s"), min(med(t[n], "lost_raw_s") for n in TARGETS[2:])
            yield (f"  (run-queue waits included, as wall - thread time: worker / best DCP = "
                   f"{rw * 1e3:.0f} / {rd * 1e3:.0f} ms = {rw / rd:.2f}x)")
            sw, si = med(w, "e2e_stretch"), med(i, "e2e_stretch")
            yield (f"- python step: busy training stretches the worker's save {sw:.2f}x "
                   f"(target <= 1.5x): {ok(sw <= 1.5)}; inline {si:.2f}x, DCP thread "
                   f"{med(t['DCP thread'], 'e2e_stretch'):.2f}x, DCP process "
                   f"{med(t['DCP process'], 'e2e_stretch'):.2f}x")
        else:
            yield (f"- torch step: lost per save worker {lw * 1e3:.0f} ms, inline "
                   f"{li * 1e3:.0f} ms, DCP thread {med(t['DCP thread'], 'lost_s') * 1e3:.0f}"
                   f" ms, DCP process {med(t['DCP process'], 'lost_s') * 1e3:.0f} ms; worker "
                   f"not worse than inline: {ok(lw <= li)}")
            sw, si = med(w, "slowdown"), med(i, "slowdown")
            yield (f"- torch step: slowdown while in flight worker {sw:.2f}x, inline "
                   f"{si:.2f}x, DCP thread {med(t['DCP thread'], 'slowdown'):.2f}x, DCP "
                   f"process {med(t['DCP process'], 'slowdown'):.2f}x; worker not worse "
                   f"than inline: {ok(sw <= si)}")
        for label, keys in (("blocked (idle and busy saves, run-queue waits left out)",
                             ("blocked_idle_own_s", "blocked_own_s")),
                            ("blocked (idle and busy saves, wall)",
                             ("blocked_idle_s", "blocked_s")),
                            ("e2e idle", ("e2e_idle_s",)),
                            ("peak extra RSS of a save (all processes)", ("rss_all",)),
                            ("peak RSS of the checkpointing (held + extra, all processes)",
                             ("rss_peak",))):
            vw, vi = med_of(w, keys), med_of(i, keys)
            ratio = vw / vi if vi > 0 else float("inf")
            yield (f"- {kind} step: {label}, worker / inline = {vw:.3g} / {vi:.3g} = "
                   f"{ratio:.2f}x (target <= 1.10x): {ok(vw <= 1.1 * vi)}")


def versus_tc(kind: str, t: dict[str, list[Row]]) -> Iterator[str]:
    """Ours (worker) against torch_checkpointing: ours / theirs of what the save cost the
    training thread and what the save took (no targets: the numbers)."""
    w, c = t["ours worker"], t[_tc.NAME]
    parts = []
    for label, key in (("lost", "lost_s"), ("lost incl. runq", "lost_raw_s"),
                       ("GIL wait", "gil_s"), ("blocked", "blocked_s"),
                       ("staged idle", "staged_idle_s"), ("slowdown", "slowdown"),
                       ("e2e idle", "e2e_idle_s"), ("e2e busy", "e2e_busy_s"),
                       ("stretch", "e2e_stretch"), ("RSS+ all", "rss_all"),
                       ("RSS peak", "rss_peak")):
        vw, vc = med(w, key), med(c, key)
        ratio = f"{vw / vc:.2f}x" if vc > 0 else "-"
        parts.append(f"{label} {vw:.3g} / {vc:.3g} = {ratio}")
    yield (f"- {kind} step: ours worker / {_tc.NAME} (s, MiB, x): " + "; ".join(parts))


def med_of(rows: list[Row], keys: tuple[str, ...]) -> float:
    """The median of every row's value under each of ``keys``."""
    return statistics.median(r[k] for r in rows for k in keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gib", type=float, default=0.5, help="state size (bf16 + 2 fp32)")
    ap.add_argument("--quick", action="store_true",
                    help="1 round, 0.125 GiB, shorter idle phases (a smoke run)")
    ap.add_argument("--parts", default="main,knobs", help="main, knobs or both")
    ap.add_argument("--kinds", default="python,torch", help="step kinds of the main table")
    ap.add_argument("--step-ms", type=float, default=1.5, help="the python step's length")
    ap.add_argument("--idle-s", type=float, default=0.5,
                    help="training steps measured before each busy save (the idle step time)")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"),
                    help="where checkpoints go (tmpfs; each is deleted once measured)")
    ap.add_argument("--json", type=Path, default=None, help="write every run here")
    ap.add_argument("--systems", default=",".join(MAIN),
                    help="the main table's systems, comma-separated (default: all)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.gib, args.idle_s = 1, 0.125, 0.25
    args.parts = set(args.parts.split(","))
    args.kinds = args.kinds.split(",")
    args.systems = [n.strip() for n in args.systems.split(",") if n.strip()]
    if unknown := [n for n in args.systems if n not in MAIN]:
        ap.error(f"unknown --systems {unknown}: {', '.join(MAIN)}")
    if _tc.NAME in args.systems and (why := _tc.missing()) is not None:
        print(why)
        args.systems.remove(_tc.NAME)
    if "main" in args.parts and not args.systems:
        raise SystemExit("no system left for the main table (--systems)")
    if os.cpu_count() is None or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 CPUs (CPU 0 for training, CPU 1 for everything else)")
    check_memory(args.gib, args.dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up /dev/shm on kill
    torch.set_num_threads(1)
    init_dist()
    load0 = os.getloadavg()
    watch = Watch(threading.get_native_id())
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-interference-", dir=args.dir) as tmp:
            runs = run_parts(args, watch, Path(tmp))
    finally:
        watch.close()
        dist.destroy_process_group()
    load1 = os.getloadavg()
    tc = f", {_tc.NAME} {_tc.version()}" if _tc.NAME in args.systems else ""
    print(f"\n{args.gib} GiB state, torch {torch.__version__}{tc}, {os.cpu_count()} CPUs, "
          f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end, "
          f"{time.time() - started:.0f} s")
    lines: list[str] = []
    for title, t in runs.items():
        lines += table(f"{title} step: the training thread", t, TRAINING)
        lines += table(f"{title} step: the save", t, SAVE)
    lines += verdicts(runs)
    for title, t in runs.items():
        lines += every_run(f"{title} step", t)
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "gib": args.gib,
                                         "load": [load0, load1], "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
