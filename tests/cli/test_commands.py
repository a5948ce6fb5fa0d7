"""The ``mithril`` console script end to end on a run written by CheckpointManager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mithril_async.cli import main
from tests.cli.conftest import MITHRIL, Runs, mithril


def test_console_script_installed() -> None:
    assert MITHRIL.exists(), "pip install --no-deps --no-build-isolation -e . creates it"


def test_ls_json_and_text(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    r = mithril("ls", runs.root, "--json")
    assert r.rc == 0, r.err
    doc = r.json()
    (run,) = doc["runs"]
    assert run["run_id"] == "run1"
    assert [v["step"] for v in run["versions"]] == runs.steps
    assert run["aliases"] == {"latest": "v000003", "best": "v000002"}
    v2 = run["versions"][1]
    assert v2["aliases"] == ["best"] and v2["bytes"] > 0 and v2["ratio"] > 0
    assert main(["ls", str(runs.run)]) == 0
    out = capsys.readouterr().out
    assert "v000003" in out and "latest" in out and "best" in out


def test_inspect_version_and_file(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(runs.run), "--version", "best", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["manifest"]["step"] == 2
    model = next(b for b in doc["blobs"] if b["key"].endswith("model.mckp"))
    names = {t["name"]: t for t in model["detail"]["tensors"]}
    w = names["emb.weight"]
    assert w["dtype"] == "float32" and w["shape"] == [300, 64] and w["raw_bytes"] == 300 * 64 * 4
    assert w["planes"] and w["transform"]
    blob = runs.run / "versions" / "v000001" / "model.mckp"
    assert main(["inspect", str(blob)]) == 0
    assert "emb.weight" in capsys.readouterr().out
    assert main(["inspect", str(runs.run / "versions" / "v000003")]) == 0
    assert "step 3" in capsys.readouterr().out


def test_verify_ok_then_names_the_damaged_block(runs: Runs,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(runs.root)]) == 0
    assert "OK" in capsys.readouterr().out
    blob = runs.run / "versions" / "v000002" / "model.mckp"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle of the blocks
    blob.write_bytes(bytes(data))
    r = mithril("verify", runs.root, "--json")
    assert r.rc == 3
    doc = r.json()
    assert doc["ok"] is False and doc["where"].endswith("v000002/model.mckp")
    assert "block" in doc["error"] and "bytes" in doc["error"]
    assert "v000002/model.mckp" in r.err
    # the undamaged version alone still verifies
    assert main(["verify", str(runs.run / "versions" / "v000003")]) == 0


def test_verify_missing_blob_and_bad_manifest(runs: Runs) -> None:
    (runs.run / "versions" / "v000001" / "rng_rank0000.json").unlink()
    assert main(["verify", str(runs.run)]) == 3
    (runs.run / "versions" / "v000003" / "manifest.json").write_text("{not json")
    assert main(["verify", str(runs.run / "versions" / "v000003")]) == 3


def test_restore_to_safetensors_and_pt(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["restore", str(runs.run), "--to", str(out)]) == 0
    sd = runs.model.state_dict()
    with safe_open(str(out), framework="pt") as f:
        assert set(f.keys()) == set(sd)
        for k in sd:
            assert torch.equal(f.get_tensor(k), sd[k])
    assert main(["restore", str(runs.run), "--to", str(out)]) == 1  # exists, no --force
    pt = tmp_path / "all.pt"
    assert main(["restore", str(runs.run), "--version", "1", "--item", "all",
                 "--to", str(pt)]) == 0
    tree = torch.load(pt, weights_only=True)
    assert set(tree) == {"model", "optimizer"} and tree["optimizer"]["state"]
    assert main(["restore", str(runs.run), "--item", "nope", "--to",
                 str(tmp_path / "x.pt")]) == 1


def test_compress_decompress_safetensors(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16),
               "b": torch.arange(1000, dtype=torch.int32), "c": torch.randn(3, generator=g)}
    src = tmp_path / "model.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt", "note": "hi"})
    assert main(["compress", str(src), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["to"].endswith("model.mckp") and doc["bytes"] < src.stat().st_size
    back = tmp_path / "back.safetensors"
    assert main(["decompress", str(tmp_path / "model.mckp"), "-o", str(back)]) == 0
    with safe_open(str(back), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "hi"}
        assert list(f.keys()) == sorted(tensors)
        for k, v in tensors.items():
            assert f.get_tensor(k).dtype == v.dtype and torch.equal(f.get_tensor(k), v)
    assert main(["verify", str(tmp_path / "model.mckp")]) == 0


def test_gc_dry_run_then_apply(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    stray = runs.run / "versions" / "v000001" / "stray.bin"
    stray.write_bytes(b"x" * 100)
    dead = runs.run / "versions" / "v000009"
    dead.mkdir()
    (dead / "model.mckp").write_bytes(b"partial")  # no claim, no manifest: abandoned
    assert main(["gc", str(runs.root), "--dry-run", "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kinds = {(i["kind"], i["what"]) for i in doc["runs"]["run1"]}
    # v000002 is 'best' and v000003 'latest': retention may only take v000001
    assert kinds == {("orphan", "runs/run1/versions/v000001"),
                     ("unfinished", "runs/run1/versions/v000009"),
                     ("retention", "v000001")}
    assert stray.exists() and dead.exists()
    assert main(["gc", str(runs.root), "--keep-last", "1"]) == 0
    assert not (runs.run / "versions" / "v000001").exists() and not dead.exists()
    assert main(["verify", str(runs.root)]) == 0


def test_bad_paths_and_usage_errors(tmp_path: Path) -> None:
    r = mithril("ls", tmp_path / "nope")
    assert r.rc == 1 and "no such file or directory" in r.err
    assert main(["inspect", str(tmp_path)]) == 1  # an empty folder is no run
    with pytest.raises(SystemExit) as exc:
        main(["verify"])
    assert exc.value.code == 2
    (tmp_path / "junk.mckp").write_bytes(b"not a blob at all")
    assert main(["verify", str(tmp_path / "junk.mckp")]) == 3
    assert main(["decompress", str(tmp_path / "missing.mckp")]) == 1


def test_verify_and_restore_follow_delta_bases(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli.conftest import make_runs

    runs = make_runs(tmp_path, delta=True)
    man = json.loads((runs.run / "versions" / "v000002" / "manifest.json").read_text())
    assert man["model"]["base"]["version_id"] == "v000001"  # a delta run, as configured
    out = tmp_path / "v3.safetensors"
    assert main(["restore", str(runs.run), "--to", str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        for k, v in runs.model.state_dict().items():
            assert torch.equal(f.get_tensor(k), v)
    base = runs.run / "versions" / "v000001" / "model.mckp"
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 0x10
    base.write_bytes(bytes(data))
    capsys.readouterr()
    # verifying only v000002 still reaches its damaged base, and names it
    assert main(["verify", str(runs.run / "versions" / "v000002")]) == 3
    err = capsys.readouterr().err
    assert "v000002/model.mckp" in err and "v000001/model.mckp" in err
