"""Run by test_resume_cuda.py in real subprocesses: train on the device, checkpoint, get
killed, resume (the CUDA twin of tests/manager/_resume_script.py).

    python -m tests.gpu._resume_cuda straight|crash|resume RUNS TOTAL OUT [blocking|overlapped]
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from mithril_async import CheckpointManager, parse_config
from tests.gpu._helpers import make_cuda_state, train_step


def main() -> None:
    mode, runs, total, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    snapshot = sys.argv[5] if len(sys.argv) > 5 else "blocking"
    torch.use_deterministic_algorithms(True)  # needs CUBLAS_WORKSPACE_CONFIG (set by the test)
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "resume"\n'
                       f"ckpting_save_iter = {total // 2}\n"
                       f'[checkpointing.pipeline]\nsnapshot = "{snapshot}"\n')
    model, opt, batcher = make_cuda_state(seed=7)
    torch.manual_seed(123)  # the device RNG drives the noise in train_step
    manager = CheckpointManager(cfg, {"model": model, "optimizer": opt, "batcher": batcher})
    start = 0
    if mode == "resume":
        start = manager.restore_sync("latest")
    for step in range(start + 1, total + 1):
        train_step(model, opt, batcher)
        if mode == "crash" and manager.should_save(step):
            handle = manager.save_nowait(step)
            train_step(model, opt, batcher)  # progress that the crash loses, queued on the
            handle.result()  # device while an overlapped snapshot's copies are in flight
            torch.cuda.synchronize()
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    cpu = {"model": {k: v.cpu() for k, v in model.state_dict().items()},
           "opt": opt.state_dict()}
    torch.save(cpu, out)


if __name__ == "__main__":
    main()
