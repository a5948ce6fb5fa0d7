"""A training process whose saves stream under ``host_memory_mib`` through its checkpoint
worker, run as ``python _stream_trainer.py RUNS``: it saves step 1 (waiting for it), then
saves step 2 and SIGKILLs itself while copying out that save's second chunk, which its
worker asked for (no timing: the kill is in the copy-out itself). Prints ``worker <pid>``.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mithril_async import CheckpointManager
from mithril_async.save.stream_snapshot import StreamSnapshot
from tests.worker.test_streamed import big_state, streamed_config

runs = sys.argv[1]
state = big_state(0)
mgr = CheckpointManager(streamed_config(runs), {"model": state})
assert mgr.process == "worker", mgr.process
mgr.__enter__()
assert mgr.save_nowait(1).result().streamed
print(f"worker {mgr.worker_pid}", flush=True)
real = StreamSnapshot.fetch
fetched = []


def dies_midway(self, lease, t, off, n):
    fetched.append(n)
    if len(fetched) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, lease, t, off, n)


StreamSnapshot.fetch = dies_midway
for t in state.tensors.values():
    t.add_(1.0)
mgr.save_nowait(2)
raise SystemExit("the trainer outlived its kill")
