"""Multi-rank checkpoints in real processes over gloo (2 and 4 ranks, launched like torchrun).

Exact resume: every rank's weights and optimizer state after "save at N/2, SIGKILL, restore,
train to N" equal bit for bit those of the run that was killed only after reaching N. The same
launches (each costs seconds here) also check: a rank failing its write, hanging, or dying;
restoring with another world size; DTensor-sharded model + optimizer restored per rank.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed._worker import run_rank
from tests.manager.conftest import state_equal
from tests.ranks import launch_ranks

TOTAL = 6
#: ranks are forked from a server that imported torch once: a spawn per rank costs seconds here
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.distributed._worker"])


def launch(scenario: str, world: int, timeout: float = 120, **args: Any) -> list[int | None]:
    """Start ``world`` ranks of ``_worker.run_rank``; return their exit codes."""
    return launch_ranks(_CTX, run_rank, world,
                        lambda rank, port: (scenario, args, rank, world, port), timeout,
                        name=scenario)


def _load(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world)]


@dataclass
class Job:
    """What one crash + resume pair of launches left behind."""

    world: int
    runs: Path
    out: Path
    run_id: str
    ref: list[dict[str, Any]]
    got: list[dict[str, Any]]


def _crash_and_resume(tmp: Path, world: int, other: Job | None = None) -> Job:
    runs, out = tmp / "runs", tmp / "out"
    out.mkdir()
    faults = other is not None
    codes = launch("crash", world, runs=str(runs), total=TOTAL, out=str(out), faults=faults)
    assert codes == [-signal.SIGKILL] * world
    ref = _load(out, "crash", world)
    run_id = ref[0]["run_id"]
    extra: dict[str, Any] = {} if other is None else {
        "other": {"runs": str(other.runs), "run_id": other.run_id}}
    codes = launch("resume", world, runs=str(runs), run_id=run_id, total=TOTAL, out=str(out),
                   **extra)
    assert codes == [0] * world
    return Job(world, runs, out, run_id, ref, _load(out, "resume", world))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _crash_and_resume(tmp_path_factory.mktemp("four"), 4)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, four: Job) -> Job:
    """2 ranks; the same launches also check failures and restoring ``four``'s run."""
    return _crash_and_resume(tmp_path_factory.mktemp("two"), 2, other=four)


def _check_resume(job: Job) -> None:
    assert all(r["run_id"] == job.run_id for r in job.ref), "ranks must agree on a fresh run id"
    for rank in range(job.world):
        ref, got = job.ref[rank], job.got[rank]
        assert got["start"] == TOTAL // 2
        assert state_equal(ref["model"], got["model"]), f"rank {rank} model"
        assert state_equal(ref["opt"], got["opt"]), f"rank {rank} optimizer"
        assert ref["batcher"] == got["batcher"]
    vdir = job.runs / job.run_id / "versions" / "v000001"
    manifest = json.loads((vdir / "manifest.json").read_text())
    assert manifest["world_size"] == job.world and manifest["resume"]["exact"] is True
    assert [s["rank"] for s in manifest["optimizer"]["shards"]] == list(range(job.world))
    assert (vdir / "model.safetensors").exists() or manifest["model"]["key"].startswith(
        str(Path(job.runs.name) / job.run_id))
    for rank in range(job.world):
        assert (vdir / f"opt_shard_rank{rank:04d}.bin").exists()
        assert (vdir / f"rng_rank{rank:04d}.json").exists()


@pytest.mark.slow
def test_four_ranks_save_kill_resume_bitwise(four: Job) -> None:
    _check_resume(four)


@pytest.mark.slow
def test_two_ranks_save_kill_resume_bitwise(two: Job) -> None:
    _check_resume(two)


@pytest.mark.slow
def test_world_size_change_is_refused_except_model_only(two: Job, four: Job) -> None:
    seen = _load(two.out, "world", 2)
    for s in seen:
        assert "saved by 4 rank(s) but this job has 2" in s["refused"]
        assert "load='model'" in s["refused"]
        assert s["step"] == TOTAL // 2
    # the model-only load is the model at the save: the same on both ranks, not the final one
    assert state_equal(seen[0]["model"], seen[1]["model"])
    assert not state_equal(seen[0]["model"], four.ref[0]["model"])


@pytest.mark.slow
def test_failing_rank_fails_the_version_on_every_rank(two: Job) -> None:
    for seen in two.ref:  # the same typed error, naming the failing rank, on every rank
        assert seen["write_error"].startswith("rank 1 failed: StorageError: injected failure")
        assert seen["wait_cause"] == "DistributedError"
        assert seen["versions_after_failure"] == ["v000001"]  # the failed version is discarded
        assert seen["after"] == "committed"  # the group is still usable after a failed save
    assert two.ref[0]["latest"] == 3  # rank 0 moves the aliases once the manifest is committed
    assert two.ref[0]["write_error"] == two.ref[1]["write_error"]
    runs = two.runs.parent / "faults_runs" / "faults" / "versions"
    exact = [json.loads((runs / v / "manifest.json").read_text())["resume"]["exact"]
             for v in ("v000001", "v000002")]
    assert exact == [True, False]  # exact only when every rank's RNG + batcher state is


@pytest.mark.slow
def test_hung_rank_times_out_and_publishes_nothing(two: Job) -> None:
    hang = two.ref[0]
    assert hang["hang_error"].startswith("rank 0/2: agree_version failed")
    assert "Timed out" in hang["hang_error"]  # gloo waited its whole timeout for rank 1
    assert hang["hang_latest"] == 3
    runs = two.runs.parent / "faults_runs" / "faults" / "versions"
    assert not (runs / "v000003" / "manifest.json").exists()


@pytest.mark.slow
def test_dead_rank_fails_fast_and_publishes_nothing(two: Job) -> None:
    (dead,) = _load(two.out, "dead", 1)
    assert dead["dead_error"].startswith("rank 0/2: agree_version failed")
    # fast: from the dead peer's closed connection, not by waiting out the (120 s) timeout
    assert "timed out" not in dead["dead_error"].lower()
    assert dead["latest_after_dead"] == TOTAL // 2
    assert dead["manifests"] == [f"{two.run_id}/versions/v000001/manifest.json"]


@pytest.mark.slow
def test_sharded_dtensor_state_restores_per_rank(two: Job) -> None:
    restored = _load(two.out, "sharded", 2)
    vdir = two.runs.parent / "sharded_runs" / "sharded" / "versions" / "v000001"
    for rank in range(2):
        saved = two.ref[rank]["sharded_saved"]
        assert state_equal(saved, restored[rank]["restored"]), f"rank {rank}"
        assert (vdir / f"model_shard_rank{rank:04d}.bin").exists()
        assert (vdir / f"opt_shard_rank{rank:04d}.bin").exists()
    assert not state_equal(two.ref[0]["sharded_saved"]["model"],
                           two.ref[1]["sharded_saved"]["model"])  # shards differ per rank


@pytest.mark.slow
def test_overlapped_snapshot_of_dtensor_shards(two: Job) -> None:
    """Each rank's optimizer-owned shards are copied after save() returns; the step right
    after it waits, so the restored version equals the state it was saved from."""
    for rank in range(2):
        seen = two.ref[rank]["overlapped"]
        assert seen["deferred"] == 8  # weight and bias, each with exp_avg, exp_avg_sq, step
        assert seen["step"] == 2
        assert state_equal(seen["saved_v2"], seen["restored_v2"]), f"rank {rank}"


@pytest.mark.slow
def test_lossy_tier_across_ranks(two: Job) -> None:
    """Each rank codes its own shards lossily; the manifest lists one lossy blob per rank."""
    for rank in range(2):
        seen = two.ref[rank]["lossy"]
        assert seen["step"] == 2
        man = seen["manifest_v2"]
        assert man["has_quantization"] is True and man["resume"]["exact"] is False
        assert [s["rank"] for s in man["lossy"]["shards"]] == [0, 1]
        assert man["lossy"]["keyframe"] is False and man["lossy"]["index"] == 1
        want, got = seen["saved_v2"]["model"], seen["restored_v2"]["model"]
        w, w2 = want["weight"], got["weight"]
        assert w.shape == w2.shape == (16, 64)
        assert not torch.equal(w, w2)  # lossy: not the saved bits ...
        assert (w2 - w).abs().max() <= 0.05 * w.abs().max()  # ... but within error_rel
        assert torch.equal(want["bias"], got["bias"])  # 16 elements < min_numel: exact
        st_w = seen["saved_v2"]["opt"]["state"]
        st_g = seen["restored_v2"]["opt"]["state"]
        assert all(torch.equal(st_w[k]["step"], st_g[k]["step"]) for k in st_w)
    assert not torch.equal(two.ref[0]["lossy"]["saved_v2"]["model"]["weight"],
                           two.ref[1]["lossy"]["saved_v2"]["model"]["weight"])
