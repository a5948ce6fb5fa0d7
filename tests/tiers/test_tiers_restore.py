"""The tier layer's restore path and what a save reports, in one process.

- A restore through the tiers checks files on the node's own tier by size only and lets the
  manager's reader verify them: a damaged local copy must still fall through to the next tier
  for that file only (one GET), and the state must come back bit for bit.
- A restore that fails for another reason than a damaged copy raises that error (no loop).
- Copies fetched from elsewhere are written back into the node folder in the background:
  after ``manager.tiers.wait()`` the node's own tier holds the version again.
- The newest version decision: a version newer than every fast-tier version, complete only
  on the remote, wins; while the fast tiers hold the newest, the remote is asked nothing
  (no GET, no HEAD).
- ``SaveResult.tiers`` names the tiers a version reached.
- Out of local space (ENOSPC on every write): that save fails, typed; the previous local
  version stays; the upload of the version committed before it still completes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager
from mithril_async.errors import SaveFailed, ShapeMismatch, StorageError
from mithril_async.storage import local as local_mod
from mithril_async.storage.memory import MemoryStore
from mithril_async.tiers import fetch, restore
from mithril_async.tiers.files import files_to_restore
from mithril_async.tiers.layer import TierLayer
from mithril_async.tiers.sources import OWN_FOLDER, REMOTE
from tests.tiers._state import same, snapshot, tiered, tiny_state, train_step
from tests.tiers._stores import CountingMemory, GatedRemote

RUN = Path("runs/r1/versions")


def _tiers(mgr: CheckpointManager) -> TierLayer:
    assert mgr.tiers is not None
    return mgr.tiers


def _saved_run(tmp_path: Path, steps: int = 2, keep_local: int = 2
               ) -> tuple[dict[str, Any], CountingMemory, dict[int, dict[str, torch.Tensor]]]:
    remote = CountingMemory()
    table = {"local": str(tmp_path / "node{node}"), "replicas": 0, "keep_local": keep_local}
    state = tiny_state(1)
    mgr = tiered(table, state, remote)
    saved = {}
    for step in range(1, steps + 1):
        train_step(state)
        res = mgr.save_nowait(step).result()
        assert res.tiers is not None and res.tiers.version_id == res.version_id
        saved[step] = snapshot(state)
    mgr.close()  # after the tiers' background work
    return table, remote, saved


def _restore(table: dict[str, Any], remote: CountingMemory, seed: int = 5
             ) -> tuple[TierLayer, Any, dict[str, Any], int]:
    state = tiny_state(seed)
    mgr = tiered(table, state, remote)
    remote.ops.clear()
    step = mgr.restore_sync()
    return _tiers(mgr), mgr, state, int(step)


def test_damaged_local_copy_falls_through_to_the_remote_for_that_file_only(
        tmp_path: Path) -> None:
    table, remote, saved = _saved_run(tmp_path)
    node = tmp_path / "node0"
    # untouched: everything from the own tier, the remote asked nothing (no GET, no HEAD)
    tiers, mgr, state, step = _restore(table, remote)
    assert step == 2 and same(snapshot(state), saved[2])
    assert set(tiers.last_sources.values()) == {OWN_FOLDER}
    assert remote.reads() == 0 and remote.ops["exists"] == 0 and remote.ops["size"] == 0
    mgr.close()
    # one flipped byte in the optimizer shard, same size: only the reader can tell
    blob = node / RUN / "v000002" / "opt_shard_rank0000.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    tiers, mgr, state, step = _restore(table, remote)
    assert step == 2 and same(snapshot(state), saved[2])
    assert tiers.last_sources["runs/r1/versions/v000002/opt_shard_rank0000.bin"] == REMOTE
    assert sum(s == REMOTE for s in tiers.last_sources.values()) == 1
    assert remote.reads() == 1
    assert "repair 1" in tiers.last_timings
    tiers.wait()  # the good copy is written back over the damaged one
    mgr.close()
    assert blob.read_bytes() != bytes(data)
    tiers, mgr, state, step = _restore(table, remote)
    assert set(tiers.last_sources.values()) == {OWN_FOLDER} and remote.reads() == 0
    mgr.close()


def test_lost_node_restores_from_the_remote_and_writes_the_copies_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "SMALL", 0)  # every copy (tiny here) as a large blob's
    table, remote, saved = _saved_run(tmp_path)
    shutil.rmtree(tmp_path / "node0")
    tiers, mgr, state, step = _restore(table, remote)
    assert step == 2 and same(snapshot(state), saved[2])
    assert set(tiers.last_sources.values()) == {REMOTE}
    tiers.wait()
    assert "written back (background)" in tiers.last_timings
    for key in tiers.last_sources:  # the node's own tier holds every file again
        assert asyncio.run(remote.get(key)) == (tmp_path / "node0" / key).read_bytes()
    mgr.close()
    tiers, mgr, state, step = _restore(table, remote)
    assert step == 2 and set(tiers.last_sources.values()) == {OWN_FOLDER}
    assert remote.reads() == 0
    # and the next save numbers its version after the recovered one
    train_step(state)
    res = mgr.save_nowait(3).result()
    assert res.version_id == "v000003"
    mgr.close()


def test_a_newer_version_only_on_the_remote_wins(tmp_path: Path) -> None:
    table, remote, saved = _saved_run(tmp_path, steps=3, keep_local=3)
    # the node's folder lost v3 (say, replaced by an older copy): v2 is the newest fast one
    shutil.rmtree(tmp_path / "node0" / RUN / "v000003")
    tiers, mgr, state, step = _restore(table, remote)
    assert step == 3 and same(snapshot(state), saved[3])
    assert {s for k, s in tiers.last_sources.items() if "/v000003/" in k} == {REMOTE}
    assert remote.ops["exists"] >= 1  # the manifest of v3 was checked on the remote
    mgr.close()


def test_restore_error_that_is_no_damaged_copy_is_raised(tmp_path: Path) -> None:
    table, remote, _ = _saved_run(tmp_path, steps=1)
    mgr = tiered(table, tiny_state(5, d=16), remote)  # another model shape: no copy fixes that
    tiers = _tiers(mgr)
    remote.ops.clear()
    with pytest.raises(ShapeMismatch, match=r"emb\.weight"):
        mgr.restore_sync()
    assert remote.reads() == 0  # every copy verified intact: nothing fetched
    assert "repair 1" in tiers.last_timings
    mgr.close()


def test_save_result_names_the_tiers_reached(tmp_path: Path) -> None:
    remote = MemoryStore()
    seen: list[Any] = []
    state = tiny_state(1)
    mgr = tiered({"local": str(tmp_path / "n{node}"), "replicas": 0}, state, remote,
                 on_save=seen.append)  # the user's callback still runs
    res = mgr.save_nowait(1).result()
    assert seen == [res]
    assert res.tiers is _tiers(mgr).results["v000001"]
    assert res.tiers.wait(60) is res.tiers
    assert set(res.tiers.reached) == {"local", "remote"} and res.tiers.errors == {}
    mgr.close()


class _DiskFull:
    """An ``os`` for :mod:`mithril_async.storage.local` where, while ``full`` is set, every
    file opened for writing but the version's claim fails with ENOSPC (the claim is tiny:
    the disk fills up under the blobs); reads and removals work."""

    def __init__(self) -> None:
        self.full = False
        self.hits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: str, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if self.full and flags & (os.O_WRONLY | os.O_RDWR) and "_claim" not in path \
                and not path.endswith(".lock"):
            self.hits += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return os.open(path, flags, mode, **kw)


def test_out_of_local_space_fails_that_save_and_keeps_the_upload_going(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _DiskFull()
    monkeypatch.setattr(local_mod, "os", disk)
    remote = GatedRemote()
    state = tiny_state(1)
    mgr = tiered({"local": str(tmp_path / "n{node}"), "replicas": 0}, state, remote)
    tiers = _tiers(mgr)
    train_step(state)
    first = mgr.save_nowait(1).result()
    assert first.status == "committed"
    assert remote.waiting.wait(60)  # v1's upload is in flight
    versions = tmp_path / "n0" / RUN
    before = {p.name: p.read_bytes() for p in (versions / "v000001").iterdir()}
    train_step(state)
    disk.full = True
    with pytest.raises(StorageError) as info:  # typed, naming the key and ENOSPC
        mgr.save_nowait(2).result()
    assert info.value.errno == errno.ENOSPC and "No space left" in str(info.value)
    with pytest.raises(SaveFailed, match="No space left"):  # and reported by the manager once
        mgr.check_for_errors()
    assert disk.hits >= 1
    disk.full = False
    # the previous local version is whole, and still the latest there
    assert {p.name: p.read_bytes() for p in (versions / "v000001").iterdir()} == before
    assert not (versions / "v000002" / "manifest.json").exists()
    assert mgr.latest_step() == 1
    assert "v000002" not in tiers.results  # nothing was committed: no tier work for it
    remote.gate.set()
    (res,) = tiers.wait()
    assert set(res.reached) == {"local", "remote"} and res.errors == {}
    assert asyncio.run(remote.exists("runs/r1/versions/v000001/manifest.json"))
    # the disk has room again: the next save reaches both tiers
    train_step(state)
    res3 = mgr.save_nowait(3).result()
    assert res3.tiers is not None and set(res3.tiers.wait(60).reached) == {"local", "remote"}
    mgr.close()


def test_strict_recover_hashes_and_writes_everything_before_it_returns(tmp_path: Path) -> None:
    table, remote, saved = _saved_run(tmp_path)
    shutil.rmtree(tmp_path / "node0")
    state = tiny_state(5)
    mgr = tiered(table, state, remote)
    tiers = _tiers(mgr)
    vid = tiers.recover()
    assert vid == "v000002" and set(tiers.last_sources.values()) == {REMOTE}
    for key in tiers.last_sources:  # on disk before the restore, nothing in the background
        assert asyncio.run(remote.get(key)) == (tmp_path / "node0" / key).read_bytes()
    assert mgr.restore_sync(vid) == 2 and same(snapshot(state), saved[2])
    mgr.close()


def test_write_back_only_writes_copies_that_verify_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "SMALL", 0)  # nothing written before the restore
    table, remote, _ = _saved_run(tmp_path)
    shutil.rmtree(tmp_path / "node0")
    mgr = tiered(table, tiny_state(5), remote)
    ctx = _tiers(mgr).ctx
    rec, _ = asyncio.run(restore.recover(ctx, "latest", lambda m: files_to_restore(m, None),
                                         light=True))
    bad, good = (f"runs/r1/versions/v000002/{n}" for n in ("opt_shard_rank0000.bin",
                                                           "model.mckp"))
    damaged = bytearray(rec.data[bad])
    damaged[7] ^= 0x01
    rec.data[bad] = bytes(damaged)
    rec.verified.difference_update({bad, good})  # as if only the reader had seen them
    asyncio.run(restore.write_back(ctx, rec))
    assert not (tmp_path / "node0" / bad).exists()
    assert (tmp_path / "node0" / good).read_bytes() == rec.data[good]
    mgr.close()
