"""The metadata models: round trips through dump_model/parse_model, version ids, the typed
errors for anything malformed or unknown, and the blob helpers of a version manifest."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from mithril_async import CheckpointManager, parse_config
from mithril_async.errors import InvalidFormat, MithrilError, UnknownFormatVersion
from mithril_async.manifest import (
    MAX_METADATA_BYTES,
    SCHEMA_VERSION,
    AliasFile,
    BaseRef,
    BlobRef,
    LossyEntry,
    OptimizerEntry,
    RankKey,
    ResumeInfo,
    RngEntry,
    RunManifest,
    ShardRef,
    VersionManifest,
    VersionSummary,
    dump_model,
    parse_model,
    version_id,
    version_number,
)

V = "runs/r/versions/v000002"
WHEN = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
HASH = "0123456789abcdef"


def blob(key: str, n: int = 100, **kw: Any) -> dict[str, Any]:
    return {"key": key, "bytes": n, "xxh64": HASH, **kw}


def manifest(**kw: Any) -> VersionManifest:
    """A full manifest: model, two optimizer shards, an extra item, RNG of two ranks."""
    fields: dict[str, Any] = {
        "run_id": "r", "version_id": "v000002", "created_at": WHEN, "step": 40,
        "world_size": 2,
        "model": BlobRef(**blob(f"{V}/model.mckp", 10, raw_bytes=40,
                                base=BaseRef(version_id="v000001",
                                             key="runs/r/versions/v000001/model.mckp",
                                             xxh64=HASH))),
        "optimizer": OptimizerEntry(shards=[
            ShardRef(rank=r, **blob(f"{V}/opt_shard_rank000{r}.bin", 20 + r)) for r in (0, 1)]),
        "extra": {"data": [ShardRef(rank=0, **blob(f"{V}/data_shard_rank0000.bin", 5,
                                                   format="json"))]},
        "rng": RngEntry(keys=[RankKey(key=f"{V}/rng_rank000{r}.json", rank=r, xxh64=HASH)
                              for r in (0, 1)]),
        "resume": ResumeInfo(base_step=40, exact=True),
        "metrics": {"loss": 0.25, "acc": 0.9},
        "compression": {"level": 3},
    }
    fields.update(kw)
    return VersionManifest(**fields)


def raw(m: Any) -> dict[str, Any]:
    return json.loads(dump_model(m))


def test_version_ids() -> None:
    assert version_id(1) == "v000001"
    assert version_id(0) == "v000000"
    assert version_id(999_999) == "v999999"
    assert version_id(1_234_567) == "v1234567"  # more than six digits when needed
    for n in (0, 1, 42, 999_999, 1_000_000, 1_234_567):
        assert version_number(version_id(n)) == n
    assert version_number("v0000010") == 10  # leading zeros beyond six digits are fine


@pytest.mark.parametrize("bad", ["", "v", "v12345", "000001", "V000001", "v00000a",
                                 "v000001x", "x000001", "v-00001", " v000001", "latest"])
def test_bad_version_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidFormat, match="not a version id") as info:
        version_number(bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MithrilError)


def test_version_manifest_round_trip() -> None:
    m = manifest()
    data = dump_model(m)
    assert data.endswith(b"\n") and data.decode("utf-8")
    back = parse_model(VersionManifest, data, "some/key")
    assert back == m
    assert back.created_at == WHEN and back.model.base is not None
    assert back.model.base.version_id == "v000001"
    assert dump_model(back) == data  # stable: the same bytes again
    d = raw(m)
    assert d["schema_version"] == SCHEMA_VERSION == 1
    assert list(d)[:3] == ["schema_version", "run_id", "version_id"]  # field order is kept
    assert d["optimizer"]["shards"][1]["rank"] == 1
    assert d["model"]["format"] == "mckp" and d["extra"]["data"][0]["format"] == "json"


def test_defaults_of_a_minimal_manifest() -> None:
    m = VersionManifest(run_id="r", version_id="v000001", created_at=WHEN, step=0,
                        model=BlobRef(**blob("runs/r/versions/v000001/model.mckp")),
                        resume=ResumeInfo(base_step=0, exact=False))
    back = parse_model(VersionManifest, dump_model(m), "k")
    assert back == m
    assert back.world_size == 1 and back.optimizer is None and back.config is None
    assert back.rng.per_rank and back.rng.keys == [] and back.extra == {}
    assert back.paths.layout_version == 1 and back.stats.bytes_out == 0
    assert back.blobs() == [m.model]
    assert back.all_keys() == ["runs/r/versions/v000001/model.mckp"]


def test_lossy_fields_are_written_only_when_used() -> None:
    d = raw(manifest())
    assert "has_quantization" not in d and "lossy" not in d  # lossless: as before the tier
    lossy = LossyEntry(keyframe=False, index=2, params={"bits": 4}, tensors=["model/w"],
                       quantized=["model/w"],
                       shards=[ShardRef(rank=0, **blob(f"{V}/lossy_rank0000.mldc", 7,
                                                       format="mldc"))])
    m = manifest(has_quantization=True, lossy=lossy)
    d = raw(m)
    assert d["has_quantization"] is True and d["lossy"]["index"] == 2
    back = parse_model(VersionManifest, dump_model(m), "k")
    assert back == m and back.lossy is not None and back.lossy.codec == "excp_delta"


def test_blobs_and_all_keys() -> None:
    lossy = LossyEntry(keyframe=True, index=0,
                       shards=[ShardRef(rank=0, **blob(f"{V}/lossy_rank0000.mldc",
                                                       format="mldc"))])
    m = manifest(lossy=lossy, has_quantization=True)
    assert [b.key for b in m.blobs()] == [
        f"{V}/model.mckp", f"{V}/opt_shard_rank0000.bin", f"{V}/opt_shard_rank0001.bin",
        f"{V}/data_shard_rank0000.bin", f"{V}/lossy_rank0000.mldc"]
    assert m.all_keys() == [b.key for b in m.blobs()] + [
        f"{V}/rng_rank0000.json", f"{V}/rng_rank0001.json"]
    assert sum(b.bytes for b in m.blobs()) == 10 + 20 + 21 + 5 + 100
    # the config blob and the delta base are not this version's blobs
    with_config = manifest(config=BlobRef(**blob("runs/r/config/train.toml", format="toml")))
    assert "runs/r/config/train.toml" not in with_config.all_keys()
    assert "runs/r/versions/v000001/model.mckp" not in m.all_keys()


def test_alias_and_run_manifest_round_trip() -> None:
    pending = AliasFile(name="best", status="pending", run_id="r", metric_name="loss",
                        mode="min", updated_at=WHEN)
    ok = AliasFile(name="latest", status="ok", run_id="r", version_id="v000002", step=40,
                   manifest_key=f"{V}/manifest.json", updated_at=WHEN)
    for alias in (pending, ok):
        assert parse_model(AliasFile, dump_model(alias), "a") == alias
    assert pending.manifest_key is None and pending.step is None
    run = RunManifest(run_id="r", created_at=WHEN, aliases={"latest": "v000002", "best": None},
                      versions=[VersionSummary(version_id="v000002", step=40, created_at=WHEN,
                                               model_key=f"{V}/model.mckp", bytes=10)])
    back = parse_model(RunManifest, dump_model(run), "run.json")
    assert back == run and back.aliases["best"] is None and back.versions[0].step == 40


def test_models_are_frozen() -> None:
    m = manifest()
    with pytest.raises(pydantic.ValidationError):
        m.step = 41  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        m.model.bytes = 0  # type: ignore[misc]
    assert m.step == 40


@pytest.mark.parametrize("data,match", [
    (b"{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'"text"', "expected a JSON object, got str"),
    (b"null", "expected a JSON object, got NoneType"),
])
def test_malformed_bytes_are_invalid_format(data: bytes, match: str) -> None:
    with pytest.raises(InvalidFormat, match=match) as info:
        parse_model(VersionManifest, data, "runs/r/versions/v000002/manifest.json")
    assert str(info.value).startswith("runs/r/versions/v000002/manifest.json: ")
    assert not isinstance(info.value, UnknownFormatVersion)


@pytest.mark.parametrize("version", [None, 0, 2, "1", 1.5])
def test_unknown_schema_versions_are_refused(version: Any) -> None:
    d = raw(manifest())
    if version is None:
        del d["schema_version"]
    else:
        d["schema_version"] = version
    with pytest.raises(UnknownFormatVersion, match="schema_version") as info:
        parse_model(VersionManifest, json.dumps(d).encode(), "where.json")
    assert isinstance(info.value, InvalidFormat) and "where.json" in str(info.value)


def _edit(path: list[Any], value: Any) -> bytes:
    d = raw(manifest())
    node = d
    for p in path[:-1]:
        node = node[p]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(d).encode()


def test_a_state_without_a_model_entry_has_no_model_field() -> None:
    """``model`` is optional: a state without a ``model`` entry keeps every item in
    ``optimizer`` / ``extra``; a manifest without one parses and names what it holds."""
    m = parse_model(VersionManifest, _edit(["model"], KeyError), "m.json")
    assert m.model is None and "model" not in m.item_names()
    assert all(b.key for b in m.blobs())
    assert '"model"' not in m.model_dump_json()


@pytest.mark.parametrize("path,value,names", [
    (["surprise"], 1, "surprise"),  # unknown fields are refused, not ignored
    (["model", "surprise"], 1, "model.surprise"),
    (["step"], -1, "step"),
    (["step"], "ten", "step"),
    (["world_size"], 0, "world_size"),
    (["version_id"], "v1", "version_id"),
    (["version_id"], "latest", "version_id"),
    (["resume"], KeyError, "resume"),
    (["model", "xxh64"], "XYZ", "model.xxh64"),
    (["model", "bytes"], -5, "model.bytes"),
    (["model", "format"], "pickle", "model.format"),
    (["model", "key"], "../../etc/passwd", "model.key"),
    (["model", "key"], "/abs/model.mckp", "model.key"),
    (["model", "base", "key"], "runs/../x", "model.base.key"),
    (["optimizer", "shards", 0, "rank"], -1, "optimizer.shards.0.rank"),
    (["rng", "keys", 1, "key"], "runs/r/.tmp-x", "rng.keys.1.key"),
    (["created_at"], "yesterday", "created_at"),
])
def test_schema_violations_are_invalid_format_naming_the_field(
        path: list[Any], value: Any, names: str) -> None:
    with pytest.raises(InvalidFormat) as info:
        parse_model(VersionManifest, _edit(path, value), "m.json")
    text = str(info.value)
    assert text.startswith("m.json: does not match the VersionManifest schema")
    assert names in text, text
    assert not isinstance(info.value, UnknownFormatVersion)


def test_alias_with_an_unsafe_or_unknown_value_is_refused() -> None:
    ok = raw(AliasFile(name="latest", status="ok", run_id="r", version_id="v000002", step=4,
                       manifest_key=f"{V}/manifest.json", updated_at=WHEN))
    for field, value in (("manifest_key", "../other/manifest.json"), ("status", "maybe"),
                         ("mode", "median")):
        bad = {**ok, field: value}
        with pytest.raises(InvalidFormat, match=field):
            parse_model(AliasFile, json.dumps(bad).encode(), "aliases/latest.json")


def test_oversized_metadata_is_refused_before_parsing() -> None:
    data = b" " * (MAX_METADATA_BYTES + 1)
    with pytest.raises(InvalidFormat, match="implausibly large"):
        parse_model(VersionManifest, data, "big.json")
    # at the limit it is parsed (and fails as what it is: not JSON)
    with pytest.raises(InvalidFormat, match="not valid JSON"):
        parse_model(VersionManifest, data[:MAX_METADATA_BYTES], "big.json")


def test_a_manifest_written_by_a_real_manager(tmp_path: Path) -> None:
    """What CheckpointManager writes parses, names every file of the version (sizes
    included) and round-trips to the same bytes."""
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path / "runs"}"\n'
                       'run_id = "run1"\nbest_metric_name = "loss"\n')
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.save_nowait(12, metrics={"loss": 0.5}).result()
    path = tmp_path / "runs" / "run1" / "versions" / "v000001" / "manifest.json"
    data = path.read_bytes()
    man = parse_model(VersionManifest, data, str(path))
    assert dump_model(man) == data
    assert (man.run_id, man.version_id, man.step, man.world_size) == ("run1", "v000001", 12, 1)
    assert man.metrics == {"loss": 0.5} and man.resume.exact is True
    assert man.optimizer is not None and [s.rank for s in man.optimizer.shards] == [0]
    for b in man.blobs():
        assert (tmp_path / b.key).stat().st_size == b.bytes, b.key
    assert all((tmp_path / k).is_file() for k in man.all_keys())
    vdir = "runs/run1/versions/v000001"
    files = {str(p.relative_to(tmp_path)) for p in path.parent.iterdir()}
    # every file of the version is named, apart from the manifest itself and the claim
    assert set(man.all_keys()) | {f"{vdir}/manifest.json", f"{vdir}/_claim.json"} == files
