"""A training process for the worker tests, run as ``python _trainer.py SCENARIO RUNS`` (a
script with no ``if __name__ == "__main__"`` guard, on purpose: the worker must start
without re-importing it).

Scenarios (each prints ``worker <pid>`` once its worker runs, and ``saved <step>`` after each
``save_nowait`` returned):

- ``kill-after-save``: saves step 1, waits for it, saves step 2, then SIGKILLs itself at once
  (the worker must commit step 2 on its own, then exit);
- ``train``: saves steps 1..3 waiting for each, restores into a fresh model, checks it.
"""

import os
import signal
import sys

# the checkout under test first (not another copy of the library on the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from tests.worker._state import expected, make_model

scenario, runs = sys.argv[1], sys.argv[2]
cfg = config_from_dict({"checkpointing": {
    "runs_path": runs, "run_id": "w", "pipeline": {"process": "worker"}}})
model = make_model()
mgr = CheckpointManager(cfg, {"model": model})
assert mgr.process == "worker", mgr.process
mgr.__enter__()


def save(step):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected(step)[name])
    handle = mgr.save_nowait(step)
    print(f"worker {mgr.worker_pid}", flush=True)
    print(f"saved {step}", flush=True)
    return handle


if scenario == "kill-after-save":
    save(1).result()
    save(2)
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "train":
    for step in (1, 2, 3):
        save(step).result()
    mgr.close()
    fresh = make_model()
    with CheckpointManager(cfg, {"model": fresh}) as m2:
        assert m2.restore_sync("latest") == 3
    assert all(torch.equal(p, expected(3)[n]) for n, p in fresh.named_parameters())
    print("restored 3", flush=True)
else:
    raise SystemExit(f"unknown scenario {scenario}")
