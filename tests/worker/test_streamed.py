"""Saves streamed under ``host_memory_mib`` in worker mode: the trainer copies each chunk of
its live tensors into a ring slot in shared memory when its worker asks, the worker encodes
it from there (nothing is staged, nothing runs inline).

Real processes: the worker is the one the manager starts; a trainer killed mid-stream is a
child script that SIGKILLs itself inside a chunk's copy-out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from mithril_async import CheckpointManager, TensorDict
from mithril_async.config import Config, config_from_dict
from tests.worker._procs import gone

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def streamed_config(runs: str | Path, **pipeline: Any) -> Config:
    """An explicit worker and a budget the state of :func:`big_state` does not fit staged."""
    return config_from_dict({"checkpointing": {
        "runs_path": str(runs), "run_id": "s",
        "compression": {"chunk_mib": 0.5, "threads": 1},
        "pipeline": {"process": "worker", "host_memory_mib": 8, **pipeline}}})


def big_state(seed: int) -> TensorDict:
    """12 MiB: 12 float32 tensors of 1 MiB, and a bfloat16 one."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(12)}
    tensors["half"] = torch.randn(1000, generator=g).bfloat16()
    return TensorDict(tensors)


def test_a_streamed_save_is_encoded_by_the_worker_and_restores_exactly(
        tmp_path: Path) -> None:
    state = big_state(0)
    with CheckpointManager(streamed_config(tmp_path / "runs"), {"model": state}) as mgr:
        assert mgr.process == "worker"
        for step in (1, 2):
            for t in state.tensors.values():
                t.add_(1.0)
            res = mgr.save_nowait(step).result()
            assert res.streamed and res.status == "committed"
            assert 0 < res.host_peak_bytes <= 8 << 20  # the worker's account of the budget
        want = {k: v.clone() for k, v in state.tensors.items()}
        pid = mgr.worker_pid
        assert pid is not None
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert "memfd:mithril" in maps  # it read the chunks from the shared ring
        assert "libtorch" not in maps
    assert gone(pid)
    fresh = big_state(1)
    with CheckpointManager(streamed_config(tmp_path / "runs"), {"model": fresh}) as mgr:
        assert mgr.restore_sync("latest") == 2
    assert all(torch.equal(fresh.tensors[k], v) for k, v in want.items())


def test_a_trainer_killed_mid_stream_abandons_that_save_only(tmp_path: Path) -> None:
    """Chunks nobody can copy out any more: the worker fails the save (nothing published,
    its folder removed), then exits; the version before it restores bit for bit."""
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(HERE / "_stream_trainer.py"), str(runs)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode < 0, proc.stderr  # killed by its own SIGKILL
    worker = int(proc.stdout.split()[proc.stdout.split().index("worker") + 1])
    assert gone(worker), "the worker outlived its trainer"
    assert (runs / "s/versions/v000001/manifest.json").exists()
    assert not (runs / "s/versions/v000002").exists()  # what it wrote is removed
    fresh = big_state(1)
    with CheckpointManager(streamed_config(runs), {"model": fresh}) as mgr:
        assert mgr.latest_step() == 1 and mgr.all_steps() == [1]
        assert mgr.restore_sync("latest") == 1
    want = big_state(0)  # what step 1 saved
    assert all(torch.equal(fresh.tensors[k], v) for k, v in want.tensors.items())
