"""Run by test_preemption.py in a real process: a training loop that a real SIGTERM reaches.

    python -m tests.manager._preempt_child MODE RUNS OUT

After step ``GATE`` the loop prints ``gate`` and blocks reading a line of stdin: the test
sends SIGTERM while it is held there, then lets it go on, so the signal provably arrived
between step ``GATE`` and step ``GATE + 1``. Every step prints ``step N`` (flushed).

- ``save``: ``should_save`` at every step; the state is cloned when a save is taken and
  written to ``OUT/saved.pt`` by a result listener (listeners hear a result before the
  signal takes effect), so the test can compare the restore with the very state saved.
- ``grace``: never asks for a save; ``signal_grace_s`` lets the signal take effect.

Neither loop ends by itself: the process ends by the signal, or the test kills it.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mithril_async import CheckpointManager, SaveResult, parse_config
from tests.manager.conftest import make_state, train_step

GATE = 3


def main() -> None:
    mode, runs, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    grace = 0.2 if mode == "grace" else 60
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "preempt"\n'
                       f'ckpting_save_iter = 1000\nsave_on_signals = ["SIGTERM"]\n'
                       f"signal_grace_s = {grace}\n[checkpointing.compression]\nthreads = 1\n")
    torch.manual_seed(123)
    model, opt, batcher = make_state(seed=7)
    saved: dict[int, Any] = {}

    def keep(res: SaveResult) -> None:
        torch.save({"step": res.step, "status": res.status, **saved[res.step]},
                   out / "saved.pt")

    manager = CheckpointManager(cfg, {"model": model, "optimizer": opt, "batcher": batcher},
                                on_result=keep)
    step = 0
    while True:
        step += 1
        train_step(model, opt, batcher)
        print(f"step {step}", flush=True)
        if mode == "save" and manager.should_save(step):
            saved[step] = copy.deepcopy({"model": model.state_dict(),
                                         "optimizer": opt.state_dict(),
                                         "batcher": batcher.get_state()})
            manager.save_nowait(step)
            # the signal's save: hold the loop until the signal takes effect, so the loop
            # cannot reach its own next save first, however fast its steps and however long
            # the save (a worker's first save starts the worker)
            end = time.monotonic() + 120
            while time.monotonic() < end:
                time.sleep(0.01)
        if step == GATE:
            print("gate", flush=True)
            sys.stdin.readline()
        if mode == "grace":
            time.sleep(0.01)  # a loop that goes on and never asks for a save


if __name__ == "__main__":
    main()
