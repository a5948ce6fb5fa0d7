"""One rank of the multi-rank non-finite guard test (test_nonfinite_dist.py): only rank 1's
own item holds a NaN; every rank writes what it saw to ``<out>/rank<r>.json``.

- ``hold``: the version commits held on every rank, ``latest`` stays at the version before,
  ``restore("latest")`` gives every rank that version, ``restore("v000002")`` the NaN back.
- ``fail``: every rank raises NonFiniteState, nothing is committed, the next save commits.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # preloaded by the forkserver: a lazy import in a forked rank raced
import torch.distributed as dist

from mithril_async import CheckpointManager, NonFiniteState, SaveFailed, TensorDict, parse_config


def _manager(runs: Path, run_id: str, mode: str, rank: int
             ) -> tuple[CheckpointManager, torch.Tensor]:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "{run_id}"\n'
                       f'nonfinite = "{mode}"\n[checkpointing.compression]\nthreads = 1\n')
    mine = torch.full((512,), float(rank + 1))
    state = {"model": TensorDict({"w": torch.ones(256)}),  # the same on both: rank 0 saves it
             "buffers": TensorDict({"b": mine})}  # each rank's own
    return CheckpointManager(cfg, state), mine


def _nans(t: torch.Tensor) -> int:
    return int(t.isnan().sum())


def hold(runs: Path, rank: int) -> dict[str, Any]:
    m, mine = _manager(runs, "hold", "hold", rank)
    with m:
        m.save_nowait(1).result()
        if rank == 1:
            mine[5] = float("nan")
        res = m.save_nowait(2).result()
        dist.barrier()  # rank 0 moves the aliases (here: none) after every rank learnt of it
        seen: dict[str, Any] = {"status": res.status, "held": res.held,
                                "nonfinite": res.nonfinite, "latest": m.latest_step()}
        mine.fill_(-1.0)
        seen["restored"] = m.restore_sync("latest")
        seen["latest_values"] = [float(mine.min()), float(mine.max())]
        seen["explicit"] = m.restore_sync("v000002")
        seen["explicit_nans"] = _nans(mine)
    return seen


def fail(runs: Path, rank: int) -> dict[str, Any]:
    m, mine = _manager(runs, "fail", "fail", rank)
    seen: dict[str, Any] = {}
    with m:
        if rank == 1:
            mine[0] = float("-inf")
        try:
            m.save_nowait(1).result()
        except NonFiniteState as err:
            seen["error"] = [type(err).__name__, str(err), err.tensors]
        try:
            m.check_for_errors()
        except SaveFailed as err:
            seen["cause"] = type(err.__cause__).__name__
        seen["steps_after_failure"] = m.all_steps()
        mine[0] = 0.0
        status = m.save_nowait(2).result().status
        dist.barrier()  # rank 0 moves the aliases after every rank learnt of the commit
        seen["after"] = [status, m.all_steps(), m.latest_step()]
    return seen


def run_rank(args: dict[str, Any], rank: int, world: int, port: int) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    runs, out = Path(args["runs"]), Path(args["out"])
    seen = {"hold": hold(runs, rank), "fail": fail(runs, rank)}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
