"""The checkpoint workers of a multi-rank job run the rank protocol among themselves: a save
every rank handed over commits though every trainer is killed; a rank that never handed its
save over fails it everywhere, cleanly. Real gloo ranks as processes, real SIGKILLs; what
happened is read from files on disk, never from timing."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tests.ranks import launch_ranks
from tests.worker._procs import alive

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.worker._peer_ranks"])

#: hang guard of a wait for a worker's exit or a version's manifest
DEADLINE_S = 180.0




def _manifests(tmp: Path) -> set[str]:
    versions = tmp / "runs" / "peers" / "versions"
    return {p.parent.name for p in versions.glob("*/manifest.json")}


def _launch(tmp: Path, scenario: str) -> list[int | None]:
    from tests.worker._peer_ranks import run_rank

    return launch_ranks(_CTX, run_rank, 2,
                        lambda rank, port: (scenario, str(tmp), rank, 2, port),
                        timeout=240, name=f"peers-{scenario}")


def _workers(tmp: Path) -> list[int]:
    return [int((tmp / f"worker_rank{r}").read_text()) for r in range(2)
            if (tmp / f"worker_rank{r}").exists()]


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still running after the hang guard."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_a_save_every_rank_handed_over_commits_after_every_trainer_is_killed(
        tmp_path: Path) -> None:
    codes = _launch(tmp_path, "kill-all")
    assert codes == [-9, -9]
    workers = _workers(tmp_path)
    assert len(workers) == 2 and os.getpid() not in workers
    end = time.monotonic() + DEADLINE_S  # the workers commit step 2 on their own
    while "v000002" not in _manifests(tmp_path) and time.monotonic() < end \
            and any(alive(p) for p in workers):
        time.sleep(0.05)
    assert not _wait_gone(workers), "a worker outlived the save"
    assert _manifests(tmp_path) == {"v000001", "v000002"}
    assert _launch(tmp_path, "restore") == [0, 0]
    for rank in range(2):
        seen = json.loads((tmp_path / f"ok_rank{rank}").read_text())
        assert seen == {"restored": 2, "exact": True}


def test_a_rank_that_never_hands_its_save_over_fails_it_everywhere(tmp_path: Path) -> None:
    codes = _launch(tmp_path, "one-never-hands-over")
    assert codes == [0, -9]
    seen = json.loads((tmp_path / "ok_rank0").read_text())
    assert seen["save2"].startswith("DistributedError") and "rank 1" in seen["save2"], seen
    # the workers have exited: whatever rank 0's worker claimed for the failed save is gone
    assert not _wait_gone([*_workers(tmp_path), int(seen["worker"])])
    assert _manifests(tmp_path) == {"v000001"}
    assert not (tmp_path / "runs" / "peers" / "versions" / "v000002").exists()


@pytest.fixture(autouse=True)
def _no_strays(tmp_path: Path) -> object:
    """No worker of a test outlives it (killed at the end if one did, and the test fails)."""
    yield
    strays = [p for p in _workers(tmp_path) if alive(p)]
    for pid in strays:
        os.kill(pid, 9)
    assert not strays, f"workers {strays} outlived the test"
