"""One rank of the multi-rank worker tests (launched with tests/ranks.py).

Scenario ``commit-then-worker-dies``: both ranks save step 1 through their workers (each rank
writes its own shard: ``sharded_model``), then save step 2, and rank 1 SIGKILLs its own worker
as soon as rank 0's claim of the version exists (the job was handed over before the claim,
and the version cannot commit without rank 1's part: its worker dies mid-save). Both ranks
must see that save fail (rank 1: WorkerExited; rank 0: the failure of rank 1), then save step
3 (rank 1 through a new worker), and restore it exactly. Each rank writes ``ok_rank<r>`` with
what it saw.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from mithril_async.errors import SaveFailed, WorkerExited
from tests.worker._state import expected, make_model


def _set(model: torch.nn.Module, step: int, rank: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected(step)[name] + rank)


def run_rank(tmp: str, rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    runs = Path(tmp) / "runs"
    cfg = config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "mr", "pipeline": {"process": "worker"},
        "compression": {"threads": 1}}})
    model = make_model()
    seen: dict[str, object] = {}
    with CheckpointManager(cfg, {"model": model}, sharded_model=True) as mgr:
        assert mgr.process == "worker" and mgr.sharded_model
        _set(model, 1, rank)
        assert mgr.save_nowait(1).result().status == "committed"
        first = mgr.worker_pid
        _set(model, 2, rank)
        handle = mgr.save_nowait(2)
        if rank == 1:
            claim = runs / "mr" / "versions" / "v000002" / "_claim.json"
            deadline = time.monotonic() + 120
            while not claim.exists():
                assert time.monotonic() < deadline, "rank 0 never claimed v000002"
                time.sleep(0.001)
            assert first is not None
            os.kill(first, signal.SIGKILL)
        try:
            handle.result()
            seen["save2"] = "committed"
        except WorkerExited as err:
            seen["save2"] = f"WorkerExited: {err}"
        except Exception as err:
            seen["save2"] = f"{type(err).__name__}: {err}"
        with contextlib.suppress(SaveFailed):
            mgr.check_for_errors()
        _set(model, 3, rank)
        seen["save3"] = mgr.save_nowait(3).result().status
        seen["new_worker"] = mgr.worker_pid != first
    fresh = make_model()
    with CheckpointManager(cfg, {"model": fresh}, sharded_model=True) as mgr:
        seen["restored"] = int(mgr.restore_sync("latest"))
    seen["exact"] = all(torch.equal(p, expected(3)[n] + rank)
                        for n, p in fresh.named_parameters())
    (Path(tmp) / f"ok_rank{rank}").write_text(json.dumps(seen))
    dist.destroy_process_group()
