"""RunLayout: every key of the seed-002 layout, key validation, run ids.

The keys are checked literally (they are the on-disk format) and against the files a real
CheckpointManager writes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from mithril_async import CheckpointManager, parse_config
from mithril_async.errors import InvalidFormat, UnsafeKey
from mithril_async.layout import RunLayout, new_run_id
from mithril_async.storage.base import check_key

RUN_ID = re.compile(r"^(\d{8}-\d{6})-([0-9a-f]{6})$")


def test_every_key_of_a_run() -> None:
    lay = RunLayout("runs", "run1")
    assert lay.root == "runs/run1"
    assert lay.config_key("train.toml") == "runs/run1/config/train.toml"
    assert lay.alias_key("latest") == "runs/run1/aliases/latest.json"
    assert lay.alias_key("best") == "runs/run1/aliases/best.json"
    assert lay.run_manifest_key == "runs/run1/run.json"
    assert lay.versions_prefix == "runs/run1/versions/"
    assert lay.version_dir(3) == "runs/run1/versions/v000003"
    assert lay.manifest_key(3) == "runs/run1/versions/v000003/manifest.json"
    assert lay.claim_key(3) == "runs/run1/versions/v000003/_claim.json"
    assert lay.model_key(3, "mckp") == "runs/run1/versions/v000003/model.mckp"
    assert lay.model_key(3, "safetensors") == "runs/run1/versions/v000003/model.safetensors"
    assert lay.shard_key(3, "optimizer", 1) == "runs/run1/versions/v000003/opt_shard_rank0001.bin"
    assert lay.shard_key(3, "model", 12) == "runs/run1/versions/v000003/model_shard_rank0012.bin"
    assert lay.shard_key(3, "data", 0) == "runs/run1/versions/v000003/data_shard_rank0000.bin"
    assert lay.lossy_key(2, 0) == "runs/run1/versions/v000002/lossy_rank0000.mldc"
    assert lay.rng_key(5, 3) == "runs/run1/versions/v000005/rng_rank0003.json"


def test_version_numbers_beyond_six_digits_and_nested_prefixes() -> None:
    lay = RunLayout("team/exp-7/runs", "r.2")
    assert lay.root == "team/exp-7/runs/r.2"
    assert lay.version_dir(1_234_567) == "team/exp-7/runs/r.2/versions/v1234567"
    assert lay.manifest_key(0) == "team/exp-7/runs/r.2/versions/v000000/manifest.json"
    assert lay.versions_prefix == "team/exp-7/runs/r.2/versions/"


def test_every_key_is_a_valid_store_key() -> None:
    lay = RunLayout("runs", "20240101-000000-abcdef")
    keys = [lay.root, lay.config_key("config.json"), lay.alias_key("best"),
            lay.run_manifest_key, lay.version_dir(9), lay.manifest_key(9), lay.claim_key(9),
            lay.model_key(9, "mckp"), lay.shard_key(9, "optimizer", 3), lay.lossy_key(9, 3),
            lay.rng_key(9, 3)]
    assert all(check_key(k) == k for k in keys)
    assert all(lay.owns(k) for k in keys[1:])  # everything but the root itself


@pytest.mark.parametrize("prefix,run_id", [
    ("runs", ""), ("runs", "../other"), ("runs", "a/../b"), ("runs", "has space"),
    ("runs", ".tmp-reserved"), ("/abs/runs", "r"), ("runs/", "r"), ("", "r"),
    ("runs", "r\\x"), ("run\x00s", "r"),
])
def test_unsafe_prefixes_and_run_ids_are_refused(prefix: str, run_id: str) -> None:
    with pytest.raises(UnsafeKey) as info:
        RunLayout(prefix, run_id)
    assert isinstance(info.value, InvalidFormat) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("make", [
    lambda lay: lay.alias_key("../latest"),
    lambda lay: lay.config_key("../../escape.toml"),
    lambda lay: lay.config_key("bad name.toml"),
    lambda lay: lay.model_key(1, "mckp/../../../../x"),
    lambda lay: lay.shard_key(1, "../x", 0),
], ids=["alias", "config-dotdot", "config-space", "model-ext", "shard-kind"])
def test_keys_built_from_unsafe_names_are_refused(make: Callable[[RunLayout], str]) -> None:
    with pytest.raises(UnsafeKey):
        make(RunLayout("runs", "run1"))


def test_owns_only_keys_inside_the_run() -> None:
    lay = RunLayout("runs", "run1")
    assert lay.owns("runs/run1/versions/v000001/model.mckp")
    assert lay.owns("runs/run1/run.json")
    assert not lay.owns("runs/run1")  # the folder itself is not a key inside it
    assert not lay.owns("runs/run10/versions/v000001/model.mckp")  # a prefix, not the run
    assert not lay.owns("runs/run2/run.json")
    assert not lay.owns("other/run1/run.json")
    assert not lay.owns("run1/versions/v000001/model.mckp")


def test_layout_is_immutable_and_comparable() -> None:
    lay = RunLayout("runs", "run1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.run_id = "other"  # type: ignore[misc]
    assert lay == RunLayout("runs", "run1") and lay != RunLayout("runs", "run2")
    assert hash(lay) == hash(RunLayout("runs", "run1"))


def test_new_run_id_is_a_utc_timestamp_plus_a_random_suffix() -> None:
    before = datetime.now(UTC).replace(microsecond=0, tzinfo=None)
    ids = [new_run_id() for _ in range(64)]
    after = datetime.now(UTC).replace(tzinfo=None)
    stamps = []
    for rid in ids:
        match = RUN_ID.match(rid)
        assert match, rid
        stamps.append(datetime.strptime(match.group(1), "%Y%m%d-%H%M%S"))
        RunLayout("runs", rid)  # usable as a run id as is
    assert all(before <= s <= after for s in stamps), (before, stamps, after)
    assert stamps == sorted(stamps)  # made later, sorts later (to the second)
    assert len({RUN_ID.match(r).group(2) for r in ids}) > 1  # type: ignore[union-attr]


def test_keys_are_where_a_real_manager_writes(tmp_path: Path) -> None:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path / "runs"}"\n'
                       'run_id = "run1"\nbest_metric_name = "loss"\n')
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.save_nowait(7, metrics={"loss": 1.0}).result()
        lay = m.layout
    assert lay == RunLayout("runs", "run1")
    on_disk = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
               if p.is_file() and not p.name.startswith(".tmp-")}
    expected = {lay.manifest_key(1), lay.claim_key(1), lay.model_key(1, "mckp"),
                lay.shard_key(1, "optimizer", 0), lay.rng_key(1, 0), lay.alias_key("latest"),
                lay.alias_key("best"), lay.run_manifest_key}
    assert expected <= on_disk, expected - on_disk
    assert all(lay.owns(k) for k in on_disk)  # nothing is written outside the run
    assert {k for k in on_disk if k.startswith(lay.versions_prefix)} == {
        k for k in expected if k.startswith(lay.version_dir(1) + "/")}
