"""Delta chains with keyframes and dedup of unchanged tensors, through the manager."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager, ChecksumMismatch, Config, MissingPrevious
from mithril_async.codec import read_info
from mithril_async.storage.memory import MemoryStore
from tests.manager.conftest import make_state, state_equal, train_step

ConfigFactory = Callable[..., Config]
DELTA = "[checkpointing.compression]\ndelta = true\nkeyframe_interval = 3\n"


def _manifest(tmp_path: Path, vid: str) -> dict[str, Any]:
    return json.loads((tmp_path / "runs" / "run1" / "versions" / vid / "manifest.json")
                      .read_text())


def _train_and_save(cfg: Config, n: int, freeze: bool = False, store: Any = None
                    ) -> tuple[list[dict[str, Any]], Any]:
    model, opt, batcher = make_state()
    if freeze:
        model.emb.weight.requires_grad_(False)  # a frozen embedding never changes
    snaps = []
    kw = {"store": store} if store is not None else {}
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, **kw) as m:
        for step in range(1, n + 1):
            train_step(model, opt, batcher)
            m.save_nowait(step).result()
            snaps.append({"model": copy.deepcopy(model.state_dict()),
                          "opt": copy.deepcopy(opt.state_dict())})
    return snaps, (model, opt)


def test_chain_with_keyframes_restores_every_version(make_config: ConfigFactory,
                                                     tmp_path: Path) -> None:
    cfg = make_config(DELTA)
    snaps, (model, opt) = _train_and_save(cfg, 7)
    bases = [(_manifest(tmp_path, f"v{i:06d}")["model"]["base"] or {}).get("version_id")
             for i in range(1, 8)]
    assert bases == [None, "v000001", "v000002", None, "v000004", "v000005", None]
    opt_bases = [(_manifest(tmp_path, f"v{i:06d}")["optimizer"]["shards"][0]["base"] or {})
                 .get("version_id") for i in range(1, 8)]
    assert opt_bases == bases
    sizes = [_manifest(tmp_path, f"v{i:06d}")["model"]["bytes"] for i in range(1, 8)]
    assert max(sizes[1], sizes[2]) < sizes[0]  # deltas are smaller than the keyframe
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        for i in (3, 6, 2, 7, 1):
            assert m.restore_sync(f"v{i:06d}") == i
            assert state_equal(snaps[i - 1]["model"], model.state_dict())
            assert state_equal(snaps[i - 1]["opt"], opt.state_dict())


def test_deltas_against_the_keyframe_restore_from_two_blobs(make_config: ConfigFactory,
                                                           tmp_path: Path) -> None:
    cfg = make_config(DELTA.replace("keyframe_interval = 3", "keyframe_interval = 4")
                      + 'delta_base = "keyframe"\n', keep_last=3)
    snaps, (model, opt) = _train_and_save(cfg, 9)
    bases = [(_manifest(tmp_path, f"v{i:06d}")["model"]["base"] or {}).get("version_id")
             for i in range(7, 10)]
    # keyframes v1, v5, v9; v6-v8 all XOR against v5 (which retention therefore keeps)
    assert bases == ["v000005", "v000005", None]
    assert (tmp_path / "runs" / "run1" / "versions" / "v000005").is_dir()
    assert not (tmp_path / "runs" / "run1" / "versions" / "v000004").exists()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        assert m.all_steps() == [5, 7, 8, 9]
        for i in (8, 5, 7, 9):
            assert m.restore_sync(f"v{i:06d}") == i
            assert state_equal(snaps[i - 1]["model"], model.state_dict())
            assert state_equal(snaps[i - 1]["opt"], opt.state_dict())
        batcher = make_state()[2]
        for step in (10, 11):  # after a restore the next version starts a new chain
            train_step(model, opt, batcher)
            m.save_nowait(step).result()
    assert _manifest(tmp_path, "v000010")["model"]["base"] is None
    assert _manifest(tmp_path, "v000011")["model"]["base"]["version_id"] == "v000010"


def test_unchanged_tensors_stored_once_and_referenced(make_config: ConfigFactory,
                                                      tmp_path: Path) -> None:
    cfg = make_config(DELTA)
    snaps, (model, opt) = _train_and_save(cfg, 5, freeze=True)
    for i in range(2, 6):
        man = _manifest(tmp_path, f"v{i:06d}")
        assert [r["version_id"] for r in man["model"]["refs"]] == ["v000001"]
        blob = (tmp_path / man["model"]["key"]).read_bytes()
        names = {t.name for t in read_info(blob).tensors}
        assert "emb.weight" not in names and "mlp.0.weight" in names
    assert "emb.weight" in {t.name for t in read_info(
        (tmp_path / _manifest(tmp_path, "v000001")["model"]["key"]).read_bytes()).tensors}
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        assert m.restore_sync("v000004") == 4  # a keyframe that references v1
        assert state_equal(snaps[3]["model"], model.state_dict())


def test_dedup_without_delta(make_config: ConfigFactory, tmp_path: Path) -> None:
    cfg = make_config("[checkpointing.compression]\ndedup = true\n")
    snaps, (model, opt) = _train_and_save(cfg, 3, freeze=True)
    man = _manifest(tmp_path, "v000003")
    assert man["model"]["base"] is None and man["model"]["refs"]
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.restore_sync("latest")
    assert state_equal(snaps[2]["model"], model.state_dict())


def test_missing_or_corrupt_base_is_never_a_silent_wrong_restore(make_config: ConfigFactory,
                                                                  tmp_path: Path) -> None:
    cfg = make_config(DELTA)
    _, (model, opt) = _train_and_save(cfg, 3)
    base_blob = tmp_path / _manifest(tmp_path, "v000002")["model"]["key"]
    data = bytearray(base_blob.read_bytes())
    data[len(data) // 3] ^= 1
    base_blob.write_bytes(bytes(data))
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        with pytest.raises(ChecksumMismatch, match="v000002"):
            m.restore_sync("v000003")
        base_blob.unlink()
        with pytest.raises(MissingPrevious, match="v000002"):
            m.restore_sync("v000003")
        (base_blob.parent / "manifest.json").unlink()
        with pytest.raises(MissingPrevious, match="v000002"):
            m.restore_sync("v000003")
        assert m.restore_sync("v000001") == 1  # the keyframe is untouched


def test_retention_keeps_bases_of_kept_versions(make_config: ConfigFactory) -> None:
    cfg = make_config(DELTA, keep_last=1)
    snaps, (model, opt) = _train_and_save(cfg, 5)
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        # v5 is a delta on v4 (keyframe): both kept, v1-v3 deleted
        assert m.all_steps() == [4, 5]
        m.restore_sync("latest")
    assert state_equal(snaps[4]["model"], model.state_dict())


def test_retention_killed_half_way_then_cleaned(make_config: ConfigFactory) -> None:
    class DyingDeletes(MemoryStore):
        """Deletes fail after ``budget`` calls, like a process killed during retention."""

        budget = 10**9

        async def delete(self, key: str) -> None:
            if self.budget <= 0:
                raise OSError(5, "killed (injected)")
            self.budget -= 1
            await super().delete(key)

    store = DyingDeletes()
    cfg = make_config(DELTA)
    snaps, (model, opt) = _train_and_save(cfg, 4, store=store)
    cfg.checkpointing.keep_last = 1
    store.budget = 2  # retention of v4..v1 dies after removing v4's manifest and claim
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        train_step(model, opt, make_state()[2])
        m.save_nowait(5).result()  # committed although retention died
        assert m.all_steps() == [1, 2, 3, 5]  # v5 is a keyframe (new manager)
    store.budget = 10**9
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        keys = asyncio.run(store.list("runs/run1/versions/v000004/"))
        assert keys == []  # the half-deleted version was cleaned at start
        for step in m.all_steps():
            m.restore_sync(step)  # every kept version still restores
        m.restore_sync(3)
    assert state_equal(snaps[2]["model"], model.state_dict())


def test_failed_delta_save_keeps_chain_base(make_config: ConfigFactory) -> None:
    class Flaky(MemoryStore):
        fail = False

        async def put_if_absent(self, key: str, data: Any) -> None:
            if self.fail and key.endswith("manifest.json"):
                raise OSError(28, "no space (injected)")
            await super().put_if_absent(key, data)

    store = Flaky()
    cfg = make_config(DELTA)
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        for step in (1, 2, 3):
            train_step(model, opt, batcher)
            if step == 2:
                store.fail = True
                with pytest.raises(Exception, match="injected"):
                    m.save_nowait(step).result()
                store.fail = False
                with pytest.raises(Exception, match="injected"):
                    m.check_for_errors()
                continue
            m.save_nowait(step).result()
        expected = copy.deepcopy(model.state_dict())
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        assert m.all_steps() == [1, 3]
        m.restore_sync(3)
    assert state_equal(expected, model.state_dict())
