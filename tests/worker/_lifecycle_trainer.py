"""A training process for the worker lifecycle tests: ``python _lifecycle_trainer.py SCENARIO
RUNS OUT`` (OUT: a folder where it writes what the test needs to know, one small file each:
``worker`` its worker's pid, ``grandchild`` a forked child's pid, ...). Every scenario waits
for its worker to be ready (``worker_ready()``, no sleep) before its first save.

- ``first-save-kill``: one ``save_nowait`` and a SIGKILL at once (it must commit);
- ``handed-then-wait``: prints ``ready`` and waits for a line on stdin, saves step 1 (the
  test stops the worker first, so the save is handed over but not done), prints ``handed``
  and waits for the signal the test sends to the whole process group;
- ``signal-save``: ``save_on_signals = ["SIGTERM"]``, trains until the signal's save is
  durable (its log on stderr; ``handed <step>`` once it is the worker's), then ends by
  SIGTERM;
- ``overlap-kill``: ``snapshot = "overlapped"``; step 1 committed, then step 2 saved while
  the overlapped copy cannot run (its thread is held), then a SIGKILL before the optimizer
  step that would finish it;
- ``fork-kill`` / ``spawn-kill``: step 1 committed, then a child that outlives the trainer
  (``os.fork``, or a process given the channel's socket), then a SIGKILL.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

# the checkout under test first (not another copy of the library on the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from tests.worker._state import expected, make_model

scenario, runs, out = sys.argv[1], sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
ckpt = {"runs_path": runs, "run_id": "w", "pipeline": {"process": "worker"},
        "ckpting_save_iter": 10**9}
if scenario == "signal-save":
    ckpt["save_on_signals"] = ["SIGTERM"]
if scenario == "overlap-kill":
    ckpt["pipeline"]["snapshot"] = "overlapped"
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mgr = CheckpointManager(config_from_dict({"checkpointing": ckpt}),
                        {"model": model, "optimizer": opt})


def tell(name, value):
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(str(value))
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def load(step):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected(step)[name])


assert mgr.process == "worker", mgr.process
assert mgr.worker_ready(120), "the worker did not start"
tell("worker", mgr.worker_pid)

if scenario == "first-save-kill":
    load(1)
    mgr.save_nowait(1)
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "handed-then-wait":
    print("ready", flush=True)
    sys.stdin.readline()
    load(1)
    mgr.save_nowait(1)
    print("handed", flush=True)
    sys.stdin.readline()  # the signal ends this process here
    raise SystemExit("no signal came")
elif scenario == "signal-save":
    print("ready", flush=True)
    for step in range(1, 10**6):  # training; the signal's save ends the process
        if mgr.should_save(step):
            load(step)
            mgr.save_nowait(step)
            print(f"handed {step}", flush=True)
        time.sleep(0.002)
elif scenario == "overlap-kill":
    load(1)
    mgr.save_nowait(1).result()
    from mithril_async.save.overlap import _executor

    held = threading.Event()
    _executor().submit(held.wait)  # the overlapped copy queues behind this and never runs
    load(2)
    mgr.save_nowait(2)  # handed over; its copy is not done
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario in ("fork-kill", "spawn-kill"):
    load(1)
    mgr.save_nowait(1).result()
    sock = mgr._worker.channel.sock.fileno()
    if scenario == "fork-kill":
        pid = os.fork()
        if pid == 0:  # the grandchild: says whether it still holds the channel, then lives on
            try:
                os.fstat(sock)
                holds = "open"
            except OSError:
                holds = "closed"
            tell("channel_in_grandchild", holds)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # the test reads the trainer's output to its end
                os.dup2(devnull, fd)
            time.sleep(600)
            os._exit(0)
    else:  # a process that inherits the channel's socket (no fork hook runs for it)
        pid = subprocess.Popen(["sleep", "600"], pass_fds=(sock,), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
    tell("grandchild", pid)
    os.kill(os.getpid(), signal.SIGKILL)
else:
    raise SystemExit(f"unknown scenario {scenario}")
