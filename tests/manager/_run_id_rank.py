"""One rank of the current-run agreement test (launched with tests/ranks.py): a manager
without ``run_id`` on a 2-rank gloo job; each rank writes the run id it got."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from mithril_async import CheckpointManager, TensorDict
from mithril_async.config import config_from_dict


def run_rank(runs: str, rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        cfg = config_from_dict({"checkpointing": {"runs_path": runs,
                                                  "pipeline": {"process": "inline"}}})
        with CheckpointManager(cfg, {"model": TensorDict({"w": torch.zeros(2)})}) as mgr:
            (Path(runs) / f"rank{rank}.txt").write_text(mgr.run_id)
    finally:
        dist.destroy_process_group()
