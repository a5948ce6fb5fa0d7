"""One rank of test_preempt_dist.py (a forkserver child, launched like torchrun).

Data-parallel training with ``save_on_signals = ["SIGTERM"]``; only rank 1 receives SIGTERM
(it sends it to itself, a real signal, between step ``SIGNAL_AT`` and the next
``should_save``). The ranks meet to agree every few calls (as many as their pace puts in
a quarter of a second), so the step they save is the same on both but depends on that pace. A result
listener writes what each rank saved to ``OUT/rank<r>.json`` (listeners hear a result before
the signal takes effect). Once its save is asked for, a rank waits to be ended by the
signal, so no rank's end breaks a collective of the other.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mithril_async import CheckpointManager, SaveResult, parse_config
from tests.distributed._worker import make, step

SIGNAL_AT = 3


def run_rank(args: dict[str, Any], rank: int, world: int, port: int) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    out = Path(args["out"])
    cfg = parse_config(f'[checkpointing]\nruns_path = "{args["runs"]}"\nrun_id = "preempt"\n'
                       'ckpting_save_iter = 1000\nsave_on_signals = ["SIGTERM"]\n'
                       "[checkpointing.compression]\nthreads = 1\n")
    model, opt, batcher = make(rank)

    def record(res: SaveResult) -> None:
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"step": res.step, "status": res.status, "version": res.version_id}))

    manager = CheckpointManager(cfg, {"model": model, "optimizer": opt, "batcher": batcher},
                                on_result=record)
    for n in range(1, 10_000):
        step(model, opt, batcher)
        if rank == 1 and n == SIGNAL_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        if manager.should_save(n):
            manager.save_nowait(n)
            threading.Event().wait()  # until the signal ends this process
    manager.close()
    raise SystemExit(3)  # no save was asked for
