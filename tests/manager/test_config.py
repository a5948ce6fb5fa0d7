"""Config loading: every example file loads; bad keys are named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from mithril_async import ConfigError, load_config
from mithril_async.config import parse_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.checkpointing.ckpting_save_iter >= 1
    assert cfg.source_toml == path.read_text()


def test_example_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"train.toml", "uncompressed.toml", "s3_mirror.toml"}


def test_defaults_and_other_tables_kept() -> None:
    cfg = parse_config("[model]\nd=3\n[checkpointing]\nkeep_last = 2\n")
    assert cfg.checkpointing.keep_last == 2
    assert cfg.checkpointing.compression.enabled is True
    assert cfg.checkpointing.pipeline.on_busy == "wait"
    assert cfg.extra["model"] == {"d": 3}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[checkpointing]\nckpting_save_iter = 0\n", "checkpointing.ckpting_save_iter"),
        ("[checkpointing]\nbogus = 1\n", "checkpointing.bogus"),
        ("[checkpointing.compression]\nlevel = 99\n", "checkpointing.compression.level"),
        ("[checkpointing.pipeline]\non_busy = 'maybe'\n", "checkpointing.pipeline.on_busy"),
        ("[checkpointing]\nbest_mode = 'up'\n", "checkpointing.best_mode"),
        ("[checkpointing]\nrun_id = '../x'\n", "checkpointing.run_id"),
        ("[checkpointing.remote]\nprefix = 'p'\n", "checkpointing.remote.bucket"),
        ("[checkpointing.remote]\nbucket = 'b12'\npart_mib = 1\n", "checkpointing.remote.part_mib"),
    ],
)
def test_bad_values_name_the_key(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")) as info:
        parse_config(text)
    assert isinstance(info.value, ValueError)


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[checkpointing\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_process_defaults_to_the_worker_and_the_environment_changes_only_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mithril_async.config import config_from_dict
    from mithril_async.errors import ConfigError

    def process(pipeline: dict[str, str]) -> str:
        cfg = config_from_dict({"checkpointing": {"pipeline": pipeline}})
        return cfg.checkpointing.pipeline.process

    monkeypatch.delenv("MITHRIL_PROCESS", raising=False)
    assert process({}) == "worker"
    monkeypatch.setenv("MITHRIL_PROCESS", "inline")
    assert process({}) == "inline"
    assert process({"process": "worker"}) == "worker"  # the key wins
    monkeypatch.setenv("MITHRIL_PROCESS", " Worker ")
    assert process({"process": "inline"}) == "inline"
    assert process({}) == "worker"
    monkeypatch.setenv("MITHRIL_PROCESS", "threads")
    with pytest.raises(ConfigError, match="MITHRIL_PROCESS='threads'"):
        process({})
