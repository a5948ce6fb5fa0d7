"""One rank of the tests of the workers' own group (launched with tests/ranks.py).

Each rank saves its own shard (``sharded_model``), through its worker, of a model holding
``expected(step) + rank``. Scenarios:

- ``kill-all``: save step 1 and wait for it (the worker is up), hand step 2 over
  (``save_nowait`` returned), write the worker's pid to ``worker_rank<r>``, SIGKILL itself:
  every trainer of the job is gone, and the workers must commit step 2 on their own.
- ``restore``: a fresh job restores ``latest`` and writes ``ok_rank<r>`` with what it got.
- ``one-never-hands-over``: both save step 1; rank 1 writes its worker's pid and
  ``dead_rank1``, then SIGKILLs itself; rank 0 waits for that file, then saves step 2, which
  must fail (rank 1 never handed it over), closes its manager and writes ``ok_rank0``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from tests.worker._state import expected, make_model

#: hang guard of a rank waiting for another's file
DEADLINE_S = 120.0


def _set(model: torch.nn.Module, step: int, rank: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected(step)[name] + rank)


def _die(tmp: Path, rank: int, mgr: CheckpointManager) -> None:
    (tmp / f"worker_rank{rank}").write_text(str(mgr.worker_pid))
    os.kill(os.getpid(), signal.SIGKILL)


def run_rank(scenario: str, tmp_s: str, rank: int, world: int, port: int) -> None:
    tmp = Path(tmp_s)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    cfg = config_from_dict({"checkpointing": {
        "runs_path": str(tmp / "runs"), "run_id": "peers",
        "pipeline": {"process": "worker"}, "compression": {"threads": 1}}})
    model = make_model()
    seen: dict[str, Any] = {}
    if scenario == "restore":
        with CheckpointManager(cfg, {"model": model}, sharded_model=True) as mgr:
            seen["restored"] = int(mgr.restore_sync("latest"))
            seen["exact"] = all(torch.equal(p, expected(seen["restored"])[n] + rank)
                                for n, p in model.named_parameters())
    else:
        mgr = CheckpointManager(cfg, {"model": model}, sharded_model=True)
        assert mgr.process == "worker"
        _set(model, 1, rank)
        assert mgr.save_nowait(1).result().status == "committed"
        if scenario == "kill-all":
            _set(model, 2, rank)
            mgr.save_nowait(2)  # handed to the worker when it returns
            _die(tmp, rank, mgr)
        assert scenario == "one-never-hands-over", scenario
        if rank == 1:
            (tmp / "dead_rank1").write_text("")
            _die(tmp, rank, mgr)
        deadline = time.monotonic() + DEADLINE_S
        while not (tmp / "dead_rank1").exists():
            assert time.monotonic() < deadline, "rank 1 never got to its end"
            time.sleep(0.01)
        _set(model, 2, rank)
        try:
            seen["save2"] = mgr.save_nowait(2).result().status
        except Exception as err:
            seen["save2"] = f"{type(err).__name__}: {err}"
        seen["worker"] = mgr.worker_pid
        try:
            mgr.close()
        except Exception as err:  # the failed save is raised again: it was seen above
            seen["close"] = type(err).__name__
    (tmp / f"ok_rank{rank}").write_text(json.dumps(seen))
    dist.destroy_process_group()
