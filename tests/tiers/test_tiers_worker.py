"""The tiers served by the checkpoint worker, in one training process (remote: in memory).

With ``process = "worker"`` a tiered save runs in the worker like any other: it writes the
blobs and the manifest into the node folder and moves ``latest_local`` there (the node's part
of the tier commit); the trainer's tier layer then uploads the version and keeps each tier's
retention, and ``SaveResult.tiers`` says what it reached. The training process writes none of
it. (Several ranks in real processes: tests/tiers/test_node_loss.py and
test_tiers_elastic.py run their tiers in workers too.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, parse_config
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore
from tests.tiers._state import snapshot, tier_config, tiny_state, train_step

RUN = Path("runs") / "r1"


def _worker_config(tmp: Path, table: dict[str, Any]) -> Any:
    return tier_config(table, parse_config(
        '[checkpointing]\nruns_path = "runs"\nrun_id = "r1"\n'
        '[checkpointing.pipeline]\nprocess = "worker"\n'
        "[checkpointing.compression]\nthreads = 1\n"))


def test_a_tiered_save_runs_in_the_worker_and_the_trainer_uploads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = MemoryStore()
    table = {"local": str(tmp_path / "node{node}"), "replicas": 0, "keep_local": 2}
    state = tiny_state(1)
    mgr = CheckpointManager(_worker_config(tmp_path, table), state, tier_remote=remote)
    assert mgr.process == "worker"  # explicit: served, neither refused nor run inline
    # from here on nothing of this process writes into the node folder but the tier layer's
    # retention (it deletes versions, and repairs the ``best`` alias of one it deleted):
    # every save's files, its manifest and its aliases come from the worker
    writes: list[str] = []
    for name in ("put", "put_private", "put_if_absent", "put_if_match", "open_writer"):
        real = getattr(LocalStore, name)

        def counted(self: LocalStore, key: str, *a: Any, _real: Any = real, **kw: Any) -> Any:
            writes.append(key)
            return _real(self, key, *a, **kw)

        monkeypatch.setattr(LocalStore, name, counted)
    saved = {}
    results = []
    for step in (1, 2, 3):
        train_step(state)
        results.append(mgr.save_nowait(step).result())
        saved[step] = snapshot(state)
    assert [r.status for r in results] == ["committed"] * 3
    assert all(r.tiers is not None and "local" in r.tiers.reached for r in results)
    assert mgr.worker_pid is not None  # and the node's commit took no torch into it
    assert "libtorch" not in Path(f"/proc/{mgr.worker_pid}/maps").read_text()
    assert mgr.tiers is not None
    reached = {r.version_id: r for r in mgr.tiers.wait()}
    assert set(reached) == {"v000001", "v000002", "v000003"}
    assert all(set(r.reached) == {"local", "remote"} and not r.errors for r in reached.values())
    assert set(writes) <= {"runs/r1/aliases/best.json"}  # uploads go to the remote store
    monkeypatch.undo()

    root = tmp_path / "node0" / RUN
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v000002", "v000003"]
    alias = json.loads((root / "aliases" / "latest_local.json").read_text())
    assert alias["version_id"] == "v000003"
    keys = asyncio.run(remote.list("runs/r1/"))
    assert sum(k.endswith("/manifest.json") for k in keys) == 3
    mgr.close()

    # the next job (worker again) resumes bit for bit from the node folder
    fresh = tiny_state(2)
    with CheckpointManager(_worker_config(tmp_path, table), fresh, tier_remote=remote) as mgr:
        assert mgr.restore_sync() == 3
        assert all(torch.equal(v, saved[3][k]) for k, v in snapshot(fresh).items())
        train_step(fresh)
        res = mgr.save_nowait(4).result()  # numbered above every tier's versions
        assert res.status == "committed" and res.version_id == "v000004"
