"""A large state (``--gib``, 5 GiB and more) saved in worker mode: time and memory against
inline saves and torch.distributed.checkpoint, and restore time against DCP.

One process, one GPT-like state (per layer: bf16 weights of a hidden size 2048 block, 1024
below 2 GiB, with ``randn * 0.02`` values, layer norms near 1, and the fp32 AdamW moments next
to them: ``exp_avg`` small signed, ``exp_avg_sq`` small positive), saved by each system in
turn:

* mithril, ``process = "worker"``: the staged snapshot lies in shared memory segments the
  worker maps (they grow with the state: a few dozen for 5 GiB);
* mithril, ``process = "inline"``;
* mithril, ``process = "worker"`` without compression (raw bytes, as DCP writes them);
* DCP ``dcp.save`` and ``dcp.async_save`` (single process, ``no_dist``).

For each: the first save (mithril: the worker's start, the staging buffers' allocation and
the segments' hand-over), then the median of ``--saves`` more: stall (how long the call
blocks) and e2e (until durable); and the peak extra memory of the training process and its
worker together (shared memory counted once), as a multiple of the state, and the most each
part rose (the trainer's own memory, the worker's, the shared staging segments). Then restores of
the last saved version, mithril vs ``dcp.load``, each checked bit for bit. Ratios are ours /
theirs. Checkpoints go to tmpfs (/dev/shm) when memory allows two versions there next to the
state and its staging copy, else to /tmp (``--dir`` chooses); each system's files are removed
before the next one runs.

    python benchmarks/bench_large_state.py [--gib 5] [--saves 2] [--dir /dev/shm] [--only ...]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mithril_async import CheckpointManager, TensorDict, parse_config

GiB = 1 << 30
State = dict[str, dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------- the state
def _hidden(gib: float) -> int:
    """The hidden size: 2048 (a layer of 0.47 GiB), 1024 for a small run."""
    return 2048 if gib >= 2 else 1024


def _layer_bytes(h: int) -> int:
    params = 12 * h * h + 13 * h  # qkv, proj, mlp up/down; their biases; two norms
    return params * (2 + 4 + 4)  # bf16 weight, fp32 exp_avg, fp32 exp_avg_sq


def gpt_state(gib: float) -> State:
    """``gib`` GiB (whole layers) of GPT-like bf16 weights and fp32 AdamW moments."""
    h = _hidden(gib)
    shapes = {"attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,),
              "attn.proj.weight": (h, h), "attn.proj.bias": (h,),
              "mlp.up.weight": (4 * h, h), "mlp.up.bias": (4 * h,),
              "mlp.down.weight": (h, 4 * h), "mlp.down.bias": (h,),
              "ln1.weight": (h,), "ln1.bias": (h,), "ln2.weight": (h,), "ln2.bias": (h,)}
    layers = max(1, round(gib * GiB / _layer_bytes(h)))
    g = torch.Generator().manual_seed(0)
    model, optim = {}, {}
    for i in range(layers):
        for name, shape in shapes.items():
            key = f"layers.{i}.{name}"
            if name.startswith("ln") and name.endswith("weight"):
                w = 1.0 + 0.05 * torch.randn(shape, generator=g)
            else:
                w = 0.02 * torch.randn(shape, generator=g)
            model[key] = w.to(torch.bfloat16)
            del w
            optim[f"{key}.exp_avg"] = 1e-3 * torch.randn(shape, generator=g)
            sq = torch.randn(shape, generator=g)
            optim[f"{key}.exp_avg_sq"] = sq.mul_(sq).mul_(1e-6)
    return {"model": model, "optim": optim}


def nbytes(sd: State) -> int:
    return sum(t.numel() * t.element_size() for d in sd.values() for t in d.values())


def fingerprint(sd: State) -> dict[str, bytes]:
    """Per tensor, a digest of its bytes (a restore is checked against it bit for bit)."""
    return {f"{item}/{k}": hashlib.blake2b(t.view(torch.uint8).numpy().data,
                                           digest_size=16).digest()
            for item, d in sd.items() for k, t in d.items()}


def scramble(sd: State) -> None:
    """Overwrite the state (a restore must bring every byte back)."""
    for d in sd.values():
        for t in d.values():
            t.fill_(-7)


# ---------------------------------------------------------------------------------- memory
def _status(pid: int) -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) << 10
    return out


def resident() -> tuple[int, int, int]:
    """Bytes resident: this process's own, its children's (the worker) own, and the shared
    memory (counted once: the staging segments both map)."""
    own = _status(os.getpid())
    kids = [_status(c.pid) for c in psutil.Process().children(recursive=True)]
    private = own.get("RssAnon", 0) + own.get("RssFile", 0)
    worker = sum(k.get("RssAnon", 0) + k.get("RssFile", 0) for k in kids)
    shared = max([own.get("RssShmem", 0)] + [k.get("RssShmem", 0) for k in kids])
    return private, worker, shared


class Peak:
    """``with Peak() as p``: ``p.extra`` = the most the total resident (:func:`resident`)
    rose above its start; ``p.parts`` = the most each part of it rose."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.before = (0, 0, 0)
        self.peak = 0
        self.parts = [0, 0, 0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = resident()
        self.peak = max(self.peak, sum(now) - sum(self.before))
        self.parts = [max(p, n - b) for p, n, b in zip(self.parts, now, self.before,
                                                         strict=True)]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> Peak:
        self.before = resident()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def extra(self) -> int:
        return self.peak


def trim() -> None:
    """Collect garbage and hand freed heap memory back to the OS, so no system runs in (or
    is charged for) memory another one left."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---------------------------------------------------------------------------------- systems
Timed = tuple[float, float]  # stall, e2e


class Mithril:
    def __init__(self, sd: State, root: Path, process: str, compress: bool = True) -> None:
        cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "bench"\n'
                           "keep_last = 1\n"
                           f'[checkpointing.pipeline]\nprocess = "{process}"\n'
                           "[checkpointing.compression]\n"
                           f"enabled = {str(compress).lower()}\n")
        self.mgr = CheckpointManager(cfg, {k: TensorDict(v) for k, v in sd.items()})
        assert self.mgr.process == process, self.mgr.process

    def save(self, i: int) -> Timed:
        t0 = time.perf_counter()
        handle = self.mgr.save_nowait(i)
        stall = time.perf_counter() - t0
        res = handle.result()
        assert res.status == "committed", res.error
        return stall, time.perf_counter() - t0

    def segments(self) -> int:
        worker = self.mgr._worker
        return 0 if worker is None else len(worker.arena.unsent(-1))

    def restore(self, step: int) -> float:
        t0 = time.perf_counter()
        self.mgr.restore_sync(step)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.mgr.close()
        del self.mgr


class Dcp:
    def __init__(self, sd: State, root: Path, asynchronous: bool) -> None:
        self.sd, self.root, self.asynchronous = sd, root, asynchronous
        self.last: Path | None = None

    def save(self, i: int) -> Timed:
        path = self.root / f"dcp{i}"
        t0 = time.perf_counter()
        if self.asynchronous:
            fut: Any = dcp.async_save(self.sd, checkpoint_id=str(path), no_dist=True)
            stall = time.perf_counter() - t0
            fut.result()
        else:
            dcp.save(self.sd, checkpoint_id=str(path), no_dist=True)
            stall = time.perf_counter() - t0
        e2e = time.perf_counter() - t0
        if self.last is not None:  # one checkpoint on disk at a time (keep_last = 1)
            shutil.rmtree(self.last)
        self.last = path
        return stall, e2e

    def restore(self, step: int) -> float:
        assert self.last is not None
        t0 = time.perf_counter()
        dcp.load(self.sd, checkpoint_id=str(self.last), no_dist=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


Row = dict[str, float]


def measure(make: Callable[[], Mithril | Dcp], saves: int, sd: State, digest: dict[str, bytes],
            restore: bool) -> Row:
    trim()
    with Peak() as peak:  # the baseline precedes the first save: staging counts against it
        system = make()
        _, first = system.save(0)
        timed = [system.save(i) for i in range(1, saves + 1)]
    row: Row = {"first": first, "stall": statistics.median(s for s, _ in timed),
                "e2e": statistics.median(e for _, e in timed), "peak": peak.extra,
                "peak trainer": peak.parts[0], "peak worker": peak.parts[1],
                "peak shared": peak.parts[2]}
    if isinstance(system, Mithril):
        row["segments"] = system.segments()
    if restore:
        scramble(sd)
        row["restore"] = system.restore(saves)
        if fingerprint(sd) != digest:
            raise SystemExit(f"{type(system).__name__}: the restored state differs")
    system.close()
    del system
    trim()
    return row


def pick_dir(state_bytes: int, asked: str | None) -> Path:
    """tmpfs when two versions fit there next to the state and its staging copy, else /tmp."""
    if asked:
        return Path(asked)
    avail = psutil.virtual_memory().available
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    need = 2 * state_bytes + 2 * GiB  # two versions on disk (keep_last = 1 mid-save), margin
    if shm >= need and avail - state_bytes >= need + state_bytes:  # + the staging copy
        return Path("/dev/shm")
    return Path(tempfile.gettempdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=5.0)
    ap.add_argument("--saves", type=int, default=2, help="timed saves after the first")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: see above)")
    ap.add_argument("--only", default=None,
                    help="comma-separated systems to run (e.g. 'mithril worker,DCP save')")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    t = time.perf_counter()
    sd = gpt_state(args.gib)
    size = nbytes(sd)
    digest = fingerprint(sd)
    print(f"state: {size / GiB:.2f} GiB, {sum(len(d) for d in sd.values())} tensors "
          f"(built in {time.perf_counter() - t:.0f} s)", flush=True)
    where = pick_dir(size, args.dir)
    rows: dict[str, Row] = {}
    with tempfile.TemporaryDirectory(prefix="bench-large-", dir=where) as tmp:
        root = Path(tmp)
        plan: dict[str, tuple[Callable[[], Mithril | Dcp], bool]] = {
            "mithril worker": (lambda: Mithril(sd, root / "w", "worker"), True),
            "mithril inline": (lambda: Mithril(sd, root / "i", "inline"), False),
            "mithril worker (raw)": (lambda: Mithril(sd, root / "r", "worker", False), True),
            "DCP save": (lambda: Dcp(sd, root / "d", False), True),
            "DCP async_save": (lambda: Dcp(sd, root / "a", True), False),
        }
        only = None if args.only is None else {n.strip() for n in args.only.split(",")}
        if only is not None and only - plan.keys():
            raise SystemExit(f"unknown systems {sorted(only - plan.keys())}; known: "
                             f"{sorted(plan)}")
        for name, (make, restore) in plan.items():
            if only is not None and name not in only:
                continue
            rows[name] = measure(make, args.saves, sd, digest, restore)
            for sub in root.iterdir():
                shutil.rmtree(sub, ignore_errors=True)
            print(f"  {name}: {rows[name]}", flush=True)
    d, da = rows.get("DCP save"), rows.get("DCP async_save")

    def ratio(r: Row, key: str, base: Row | None) -> str:
        return "-" if base is None or key not in r or key not in base else (
            f"{r[key] / base[key]:.2f}")

    print(f"\n{size / GiB:.2f} GiB GPT-like state (bf16 weights, fp32 AdamW moments), "
          f"checkpoints in {where}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"median of {args.saves} saves after the first")
    print("| system | first save s | stall s | e2e s | e2e / DCP save | e2e / DCP async | "
          "peak extra (x state) | of it trainer / worker / shared | restore s | "
          "restore / DCP |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        restored = f"{r['restore']:.2f}" if "restore" in r else "-"
        print(f"| {name} | {r['first']:.2f} | {r['stall']:.3f} | {r['e2e']:.2f} | "
              f"{ratio(r, 'e2e', d)} | {ratio(r, 'e2e', da)} | "
              f"{r['peak'] / size:.2f} | {r['peak trainer'] / size:.2f} / "
              f"{r['peak worker'] / size:.2f} / {r['peak shared'] / size:.2f} | "
              f"{restored} | {ratio(r, 'restore', d)} |")
    w, i = rows.get("mithril worker"), rows.get("mithril inline")
    if w is not None and i is not None:
        print(f"\nworker / inline e2e: {w['e2e'] / i['e2e']:.2f}; stall: "
              f"{w['stall'] / i['stall']:.2f}; worker's staging segments: "
              f"{int(w.get('segments', 0))}")

if __name__ == "__main__":
    main()
