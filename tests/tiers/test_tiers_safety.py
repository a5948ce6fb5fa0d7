"""What the tier layer must never do, in one process (remote: an in-memory store).

- Overwrite a version on the remote: a job whose node folder is new (fixed ``run_id``) that
  saves before any restore numbers its save above every version the remote holds; an object
  the remote already holds under a key of the version being uploaded is left alone, and that
  upload fails typed (``KeyExists``), without publishing the manifest.
- Delete from the node folder a version whose upload has not run yet (retention while an
  upload lags behind more than ``keep_local`` saves).
- Leave a manifest without its files in the node folder after a recovery or restore that
  failed: the folder is as the recovery found it.
- Fetch or write a file that a manifest read from the remote names outside its run: the
  manifest is refused first, as the restore reader refuses it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager
from mithril_async.errors import DistributedError, InvalidFormat, KeyExists, ShapeMismatch
from mithril_async.manifest import AliasFile, VersionManifest, dump_model, parse_model
from mithril_async.tiers import Place, Source
from tests.tiers._state import same, snapshot, tiered, tiny_state, train_step
from tests.tiers._stores import CountingMemory, GatedRemote

VERSIONS = "runs/r1/versions"


def _manager(tmp_path: Path, folder: str, remote: Any, state: dict[str, Any],
             **table: Any) -> CheckpointManager:
    return tiered({"local": str(tmp_path / folder), "replicas": 0, **table}, state, remote)


def _save_steps(tmp_path: Path, folder: str, remote: Any, steps: list[int], seed: int = 1,
                **table: Any) -> dict[int, Any]:
    """A fresh state saved at each of ``steps`` (one training step before each); the
    snapshots by step, once every version's tier work ended."""
    state = tiny_state(seed)
    mgr = _manager(tmp_path, folder, remote, state, **table)
    saved = {}
    for step in steps:
        train_step(state)
        mgr.save_nowait(step).result()
        saved[step] = snapshot(state)
    mgr.close()  # after the tiers' background work
    return saved


def _restored(tmp_path: Path, folder: str, remote: Any, target: str = "latest",
              seed: int = 9) -> tuple[int, Any]:
    state = tiny_state(seed)
    mgr = _manager(tmp_path, folder, remote, state)
    try:
        step = int(mgr.restore_sync(target))
    finally:
        mgr.close()
    return step, snapshot(state)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_fresh_node_folder_numbers_above_the_remote_and_never_overwrites_it(
        tmp_path: Path) -> None:
    remote = CountingMemory()
    first = _save_steps(tmp_path, "old{node}", remote, [1])
    # another machine, the same run id, a save before any restore
    state = tiny_state(2)
    mgr = _manager(tmp_path, "new{node}", remote, state)
    train_step(state)
    res = mgr.save_nowait(5).result()
    assert res.version_id == "v000002"  # above the remote's v000001, not over it
    assert res.tiers is not None and res.tiers.wait(60).errors == {}
    second = snapshot(state)
    # an object planted where the next version will be uploaded: left alone, upload refused
    planted = f"{VERSIONS}/v000003/model.mckp"
    asyncio.run(remote.put(planted, b"another job's model"))
    train_step(state)
    res3 = mgr.save_nowait(6).result()
    assert res3.version_id == "v000003" and res3.status == "committed"
    assert res3.tiers is not None
    out = res3.tiers.wait(60)
    assert set(out.reached) == {"local"}
    assert isinstance(out.failures["remote"], KeyExists)
    assert "KeyExists" in out.errors["remote"] and planted in out.errors["remote"]
    assert asyncio.run(remote.get(planted)) == b"another job's model"
    assert not asyncio.run(remote.exists(f"{VERSIONS}/v000003/manifest.json"))
    latest = parse_model(AliasFile, asyncio.run(remote.get("runs/r1/aliases/latest.json")), "")
    assert latest.version_id == "v000002"
    assert mgr.latest_step() == 6  # the local commit stands
    mgr.close()
    # both versions restore bit for bit from the remote alone
    step, got = _restored(tmp_path, "a{node}", remote, "v000001")
    assert step == 1 and same(got, first[1])
    step, got = _restored(tmp_path, "b{node}", remote, "v000002")
    assert step == 5 and same(got, second)


def test_retention_keeps_versions_whose_upload_has_not_run(tmp_path: Path) -> None:
    """keep_local = 2 while v000001's upload is held and three more saves commit: every
    version still reaches the remote (none is deleted locally before its upload)."""
    remote = GatedRemote("v000001")
    state = tiny_state(1)
    mgr = _manager(tmp_path, "n{node}", remote, state, keep_local=2)
    for step in (1, 2, 3, 4):
        train_step(state)
        assert mgr.save_nowait(step).result().status == "committed"
        if step == 1:
            assert remote.waiting.wait(60)  # v000001's upload is in flight
    remote.gate.set()
    assert mgr.tiers is not None
    results = mgr.tiers.wait()
    assert [(r.version_id, sorted(r.reached), r.errors) for r in results] == [
        (f"v00000{n}", ["local", "remote"], {}) for n in (1, 2, 3, 4)]
    for n in (1, 2, 3, 4):
        assert asyncio.run(remote.exists(f"{VERSIONS}/v00000{n}/manifest.json")), n
    # once every upload ran, keep_local holds again
    assert sorted(p.name for p in (tmp_path / "n0" / VERSIONS).iterdir()) == [
        "v000003", "v000004"]
    mgr.close()


def test_failed_recovery_leaves_the_node_folder_as_it_found_it(tmp_path: Path) -> None:
    remote = CountingMemory()
    _save_steps(tmp_path, "n{node}", remote, [1, 2])
    node = tmp_path / "n0"
    # 1. a file of the newest version is intact on no tier: the recovery fails
    shutil.rmtree(node)
    asyncio.run(remote.delete(f"{VERSIONS}/v000002/opt_shard_rank0000.bin"))
    mgr = _manager(tmp_path, "n{node}", remote, tiny_state(5))
    before = _files(node)
    with pytest.raises(DistributedError, match=r"opt_shard_rank0000.bin of v000002 is intact "
                                               r"on no tier"):
        mgr.restore_sync()
    assert _files(node) == before  # no manifest (nor anything else) without its files
    mgr.close()
    # 2. every file fetched (small ones written before the restore), then the restore
    # fails for good (another model shape): what the recovery wrote is taken back
    asyncio.run(remote.delete(f"{VERSIONS}/v000002/manifest.json"))  # v000001 is latest now
    shutil.rmtree(node)
    mgr = _manager(tmp_path, "n{node}", remote, tiny_state(5, d=16))
    before = _files(node)
    with pytest.raises(ShapeMismatch):
        mgr.restore_sync()
    assert mgr.tiers is not None
    assert mgr.tiers.last_sources and set(mgr.tiers.last_sources.values()) == {
        Source(Place.REMOTE)}
    assert _files(node) == before
    mgr.close()


def test_remote_manifest_naming_another_run_is_refused_before_any_fetch(
        tmp_path: Path) -> None:
    """A manifest planted in the bucket as the newest version, naming another run's file
    (with its true size and hash): recovery of ``latest`` skips it for the newest version it
    can trust; asked for by name it is refused (InvalidFormat) before anything is fetched or
    written. The other run's file is never read, nor written into the node folder."""
    remote = CountingMemory()
    saved = _save_steps(tmp_path, "n{node}", remote, [1, 2], keep_local=3)
    v2 = parse_model(VersionManifest,
                     asyncio.run(remote.get(f"{VERSIONS}/v000002/manifest.json")), "v2")
    foreign = "runs/other/versions/v000001/model.mckp"
    asyncio.run(remote.put(foreign, asyncio.run(remote.get(v2.model.key))))
    planted = v2.model_copy(update={"version_id": "v000003", "step": 3, "model":
                                    v2.model.model_copy(update={"key": foreign})})
    asyncio.run(remote.put(f"{VERSIONS}/v000003/manifest.json", dump_model(planted)))
    node = tmp_path / "n0"

    remote.calls.clear()
    step, got = _restored(tmp_path, "n{node}", remote)
    assert step == 2 and same(got, saved[2])
    mgr = _manager(tmp_path, "n{node}", remote, tiny_state(9))
    with pytest.raises(InvalidFormat, match=r"outside its run"):
        mgr.restore_sync("v000003")
    mgr.close()
    assert [c for c in remote.calls if c[1] == foreign] == []
    assert not (node / "runs" / "other").exists()
    assert not (node / VERSIONS / "v000003").exists()
