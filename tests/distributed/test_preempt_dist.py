"""One rank's preemption signal makes every rank save the same step (2 gloo ranks)."""

from __future__ import annotations

import json
import multiprocessing
import signal
from pathlib import Path

from tests.distributed._preempt_worker import SIGNAL_AT, run_rank
from tests.ranks import launch_ranks

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.distributed._preempt_worker"])


def test_one_ranks_signal_saves_the_same_step_on_every_rank_then_both_end_by_it(
        tmp_path: Path) -> None:
    args = {"runs": str(tmp_path / "runs"), "out": str(tmp_path)}
    codes = launch_ranks(_CTX, run_rank, 2, lambda rank, port: (args, rank, 2, port), 120,
                         name="preempt")
    # rank 1 by its own SIGTERM, rank 0 (never signalled) by the agreed one, both after
    # their save was durable
    assert codes == [-signal.SIGTERM, -signal.SIGTERM]
    saved = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert saved[0] == saved[1]  # the same step, in the same version, on both ranks
    assert saved[0]["status"] == "committed" and saved[0]["version"] == "v000001"
    assert saved[0]["step"] > SIGNAL_AT  # acted on at a meeting after the signal
    manifest = json.loads((tmp_path / "runs" / "preempt" / "versions" / "v000001" /
                           "manifest.json").read_text())
    assert manifest["step"] == saved[0]["step"] and manifest["world_size"] == 2
