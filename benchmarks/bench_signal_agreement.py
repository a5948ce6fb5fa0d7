"""What ``should_save(step)`` costs per step with ``save_on_signals`` on several ranks.

``--world`` gloo ranks on 127.0.0.1 run a data-parallel-like loop: per step some compute
(``--compute-ms`` of matmuls), a small all-reduce on the default group (the gradient
all-reduce that keeps ranks in lockstep), then ``manager.should_save(step)``, timed alone.
With ``save_on_signals`` each call collects the previous call's all-reduce (max) of the
ranks' fresh signals on the agreement's own gloo group and posts this call's; without it,
the call is a modulo. No signal arrives: this is the price paid at every step. Columns:
the median of calls that are no meeting, the median of meetings (collect + post), the mean
of all calls (the cost per step), and how many calls apart the meetings were.

    python benchmarks/bench_signal_agreement.py [--world 2] [--steps 2000] [--compute-ms 0 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mithril_async import CheckpointManager, parse_config


def _busy(ms: float, x: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x @ x


def _loop(manager: CheckpointManager, steps: int, compute_ms: float
          ) -> tuple[list[float], list[float]]:
    """Seconds per call: (calls that were no meeting, meetings)."""
    ag = None if manager.preemption is None else manager.preemption.agreement
    x, grad = torch.randn(64, 64), torch.zeros(1024)
    plain: list[float] = []
    met: list[float] = []
    for step in range(1, steps + 1):
        _busy(compute_ms, x)
        dist.all_reduce(grad)
        before = 0 if ag is None else ag.meetings
        t0 = time.perf_counter()
        manager.should_save(step)
        took = time.perf_counter() - t0
        (met if ag is not None and ag.meetings != before else plain).append(took)
    return plain, met


def rank_main(rank: int, world: int, port: int, steps: int, compute: list[float],
              runs: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    model = torch.nn.Linear(8, 8)
    rows = []
    for signals in ("[]", '["SIGTERM"]'):
        cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "bench"\n'
                           f"ckpting_save_iter = {10 ** 9}\nsave_on_signals = {signals}\n")
        manager = CheckpointManager(cfg, {"model": model})
        for ms in compute:
            _loop(manager, 100, ms)  # warm-up
            plain, met = _loop(manager, steps, ms)
            rows.append((signals, ms, statistics.median(plain) * 1e6,
                         statistics.median(met) * 1e6 if met else 0.0,
                         statistics.fmean(plain + met) * 1e6, steps / len(met) if met else 0.0))
        manager.close()
    if rank == 0:
        with open(out, "w") as f:
            for r in rows:
                f.write("\t".join(str(v) for v in r) + "\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 2.0])
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.tsv")
        mp.spawn(rank_main, args=(a.world, port, a.steps, a.compute_ms,
                                  os.path.join(tmp, "runs"), out), nprocs=a.world)
        rows = [line.split("\t") for line in Path(out).read_text().splitlines()]
    print(f"should_save() per step, {a.world} gloo ranks, {a.steps} steps (rank 0, µs)")
    print(f"{'save_on_signals':<16} {'compute ms':>10} {'median':>8} {'meeting':>8} "
          f"{'mean':>8} {'calls/meeting':>13}")
    for signals, ms, med, meeting, mean, every in rows:
        print(f"{signals:<16} {float(ms):>10.1f} {float(med):>8.1f} {float(meeting):>8.1f} "
              f"{float(mean):>8.1f} {float(every):>13.1f}")


if __name__ == "__main__":
    main()
