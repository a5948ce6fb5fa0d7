"""Write ``tests/golden/run_before_rank_folders/``: a sharded run of 17 simulated ranks.

The committed copy was written by the library as it was before rank folders and piece
layouts (commit 4914327 plus the simulation helpers of ``mithril_async.testing``): every
rank's files directly in the version folder, every piece listed in each rank's manifest
entry. Newer libraries must keep restoring it (``tests/test_scale_sim.py``); do not
regenerate it with a newer library, that would test nothing.

    PYTHONPATH=<that checkout> python tests/golden/make_golden_run.py <out folder>
"""

from __future__ import annotations

import sys
from pathlib import Path

from mithril_async import CheckpointManager
from mithril_async.config import config_from_dict
from mithril_async.storage.local import LocalStore
from mithril_async.testing.ranks import SimGroup
from mithril_async.testing.sharded import fsdp_state, mesh_for

WORLD = 17
PARAMS = 2


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    store = LocalStore(out)
    group = SimGroup(WORLD)
    mesh = mesh_for(WORLD)
    cfg = config_from_dict({"checkpointing": {"run_id": "sim", "runs_path": "runs",
                                              "compression": {"threads": 1}}})
    managers = []
    for r in range(WORLD):
        model, opt = fsdp_state(PARAMS, mesh, r)
        managers.append(CheckpointManager(cfg, {"model": model, "optimizer": opt},
                                          store=store, runs_prefix="runs",
                                          coordinator=group.coordinator(r),
                                          sharded_model=True))
    handles = [m.save_nowait(1) for m in managers]
    for h in handles:
        h.result()
    for m in managers:
        m.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
