"""Smoke check of an installed mithril_async: ``python dist_smoke.py [RUNS_DIR]``.

Run by the release wheel builds (``[tool.cibuildwheel] test-command``) and by
tests/test_dist.py inside a fresh virtual environment, from a directory outside the checkout:
for ``process = "inline"`` and ``process = "worker"`` it saves a tiny model twice with
:class:`~mithril_async.CheckpointManager`, restores ``latest`` into a fresh model and checks
every tensor. Prints ``mithril_async <version> from <path>`` and ``ok <process>`` lines.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def round_trip(runs: Path, process: str) -> None:
    """Save steps 1 and 2 of a small model, restore ``latest`` into a fresh one, compare."""
    import torch

    from mithril_async import CheckpointManager
    from mithril_async.config import config_from_dict

    cfg = config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": f"smoke-{process}",
        "pipeline": {"process": process}}})
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    with CheckpointManager(cfg, {"model": model}) as mgr:
        if mgr.process != process:
            raise SystemExit(f"asked for process={process!r}, got {mgr.process!r}")
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(float(step))
            mgr.save_nowait(step).result()
    fresh = torch.nn.Linear(16, 8)
    with CheckpointManager(cfg, {"model": fresh}) as mgr:
        step = mgr.restore_sync("latest")
    if step != 2:
        raise SystemExit(f"{process}: restored step {step}, expected 2")
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, fresh.state_dict()[name]):
            raise SystemExit(f"{process}: tensor {name!r} differs after the round trip")
    print(f"ok {process}", flush=True)


def main(argv: list[str]) -> int:
    import mithril_async

    print(f"mithril_async {mithril_async.__version__} from {Path(mithril_async.__file__).parent}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(argv[0]) if argv else Path(tmp)
        for process in ("inline", "worker"):
            round_trip(runs, process)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
