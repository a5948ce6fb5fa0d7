"""Run by test_resume.py in real subprocesses: train, checkpoint, get killed, resume."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from mithril_async import CheckpointManager, parse_config
from tests.manager.conftest import make_state, train_step


def main() -> None:
    mode, runs, total, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    snapshot = sys.argv[5] if len(sys.argv) > 5 else "blocking"
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "resume"\n'
                       f"ckpting_save_iter = {total // 2}\n"
                       f'[checkpointing.pipeline]\nsnapshot = "{snapshot}"\n')
    torch.manual_seed(123)  # the global RNG drives the noise in train_step
    model, opt, batcher = make_state(seed=7)
    manager = CheckpointManager(cfg, {"model": model, "optimizer": opt, "batcher": batcher})
    start = 0
    if mode == "resume":
        start = manager.restore_sync("latest")
    for step in range(start + 1, total + 1):
        train_step(model, opt, batcher)
        if mode == "crash" and manager.should_save(step):
            handle = manager.save_nowait(step)
            train_step(model, opt, batcher)  # progress that the crash loses (an overlapped
            handle.result()  # snapshot's copy runs while this step's forward/backward do)
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)


if __name__ == "__main__":
    main()
