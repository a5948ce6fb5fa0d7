"""The one reader: every restore path verifies the same things, and reading writes nothing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, Config
from mithril_async.catalog import open_catalog
from mithril_async.errors import ChecksumMismatch, DistributedError, InvalidFormat
from mithril_async.restore.reader import VersionReader, read_version
from tests.manager.conftest import make_state, state_equal, train_step


def _saved_run(make_config: Any, saves: int = 3) -> tuple[Path, list[dict[str, Any]]]:
    """A run with ``saves`` versions; returns the runs folder and each version's model."""
    cfg: Config = make_config(best_metric_name="loss")
    model, opt, batcher = make_state()
    states = []
    with CheckpointManager(cfg, {"model": model, "optimizer": opt, "data": batcher}) as m:
        for step in range(1, saves + 1):
            train_step(model, opt, batcher)
            m.save_nowait(step, metrics={"loss": float(step)}).result()
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    return Path(cfg.checkpointing.runs_path), states


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def _rng_file(runs: Path, vid: str) -> Path:
    return next((runs / "run1" / "versions" / vid).glob("rng*"))


def test_every_restore_path_refuses_a_damaged_rng_file(make_config: Any, tmp_path: Path
                                                       ) -> None:
    """The RNG/data-state file is checked against the manifest by the manager's restore and
    by the tools' reads alike (the tools' old read path loaded it unchecked)."""
    runs, _ = _saved_run(make_config, saves=2)
    rng = _rng_file(runs, "v000002")
    rng.write_bytes(rng.read_bytes().replace(b'"position": 2', b'"position": 7'))
    with pytest.raises(ChecksumMismatch):
        asyncio.run(read_version(open_catalog(runs, "run1"), "latest"))
    model, opt, batcher = make_state(seed=1)
    with CheckpointManager(make_config(), {"model": model, "optimizer": opt, "data": batcher}
                           ) as m, pytest.raises(ChecksumMismatch):
        m.restore_sync("latest")
    # the undamaged older version still reads, through the same reader
    assert asyncio.run(read_version(open_catalog(runs, "run1"), 1)).rng["step"] == 1


def test_a_manifest_whose_step_was_changed_is_caught_by_the_rng_file(make_config: Any) -> None:
    runs, _ = _saved_run(make_config, saves=1)
    manifest = runs / "run1" / "versions" / "v000001" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step": 1', b'"step": 5', 1))
    with pytest.raises(InvalidFormat, match="saved at step 1"):
        asyncio.run(read_version(open_catalog(runs, "run1"), "v000001"))


def test_fallback_returns_the_newest_version_that_verifies(make_config: Any) -> None:
    runs, states = _saved_run(make_config, saves=3)
    blob = next((runs / "run1" / "versions" / "v000003").glob("model*"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    catalog = open_catalog(runs, "run1")
    with VersionReader(catalog) as reader:
        with pytest.raises(ChecksumMismatch):
            asyncio.run(reader.read_version("latest"))
        got = asyncio.run(reader.read_version("latest", fallback=True))
    assert got.manifest.version_id == "v000002" and got.rng["step"] == 2
    assert state_equal(got.trees["model"], states[1])


def test_world_size_is_checked_only_for_a_resume(make_config: Any) -> None:
    runs, states = _saved_run(make_config, saves=1)
    catalog = open_catalog(runs, "run1")
    with pytest.raises(DistributedError, match="saved by 1 rank"):
        asyncio.run(read_version(catalog, "latest", world_size=2, rank=1))
    # the full model of rank 0 loads on any world size; tools pass no world size at all
    got = asyncio.run(read_version(catalog, "latest", world_size=2, rank=1, items={"model"},
                                   rng=False))
    assert set(got.trees) == {"model"} and got.rng == {}
    assert state_equal(got.trees["model"], states[0])
    assert set(asyncio.run(read_version(catalog, "latest")).trees) == {"model", "optimizer"}


def test_reading_writes_nothing(make_config: Any) -> None:
    runs, _ = _saved_run(make_config, saves=2)
    os.utime(runs / "run1", None)
    before = _files(runs)
    catalog = open_catalog(runs, "run1")
    with VersionReader(catalog) as reader:
        for target in ("latest", "best", 1, "v000002"):
            asyncio.run(reader.read_version(target, fallback=True))
        for m in asyncio.run(catalog.versions()):
            for ref in m.blobs():
                _, tensors = asyncio.run(reader.read(ref))
                assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert _files(runs) == before
