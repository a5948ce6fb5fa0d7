"""``mithril export RUN|VERSION --hf OUT_DIR``: the console script end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mithril_async.cli import main
from tests.cli.conftest import Runs, make_runs, mithril


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """One run for the module: export only reads it."""
    return make_runs(tmp_path_factory.mktemp("export"))


def _load(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_export_a_run_and_a_version_folder(saved: Runs, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    runs = saved
    r = mithril("export", runs.run, "--hf", tmp_path / "hf", "--max-shard-size", "40KB",
                "--dtype", "bfloat16", "--json")
    assert r.rc == 0, r.err
    doc = r.json()
    assert doc["version_id"] == "v000003" and doc["step"] == 3 and doc["dtype"] == "bfloat16"
    # emb 300x64 and head 300x64 bf16 (38,400 bytes each) fill a 40 kB file each
    assert doc["shards"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(doc["shards"])
    assert index["metadata"]["total_size"] == doc["total_size"] == sum(
        t.numel() * 2 for t in runs.model.state_dict().values())
    got = _load(tmp_path / "hf")
    want = runs.model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.bfloat16()), k

    # a version folder: that version, in one file, in the saved dtype
    assert main(["export", str(runs.run / "versions" / "v000001"), "--hf",
                 str(tmp_path / "v1")]) == 0
    out = capsys.readouterr().out
    assert "v000001 (step 1)" in out and "weights only" in out
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == ["model.safetensors"]
    v1 = _load(tmp_path / "v1")
    assert all(t.dtype == torch.float32 for t in v1.values())
    assert not torch.equal(v1["lin.weight"], want["lin.weight"])  # trained since step 1


def test_export_refuses_a_folder_that_is_not_empty_and_bad_input(
        saved: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = saved
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(runs.run), "--hf", str(out)]) == 1
    assert "not empty (use force=True / --force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["export", str(runs.run), "--hf", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
    capsys.readouterr()
    for args, message in (
            (["--max-shard-size", "5XB"], "max_shard_size: '5XB' is not a size"),
            (["--dtype", "int8"], "dtype: 'int8' is not a floating-point dtype"),
            (["--version", "v000009"], "no committed version 'v000009'"),
            (["--item", "scheduler"], "has no 'scheduler' state")):
        assert main(["export", str(runs.run), "--hf", str(tmp_path / "x"), *args]) == 1, args
        assert message in capsys.readouterr().err, args
        assert not (tmp_path / "x").exists()  # nothing written on any error
    assert main(["export", str(runs.root), "--hf", str(tmp_path / "x")]) == 2
