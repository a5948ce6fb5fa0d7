"""A 2-rank sharded run exported to Hugging Face's format: each tensor consolidated from the
saved pieces equals the global tensor (real gloo ranks; ``ShardedModel`` with ``Shard(0)``,
``Shard(1)`` and ``Replicate`` placements, and FSDP2 ``fully_shard``)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mithril_async.export import export_hf
from tests.distributed._reshard_worker import run_rank
from tests.ranks import launch_ranks

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.distributed._reshard_worker"])


def _save(tmp: Path, scenario: str) -> tuple[Path, list[dict[str, Any]]]:
    runs, out = tmp / "runs", tmp / "dumps"
    out.mkdir()
    codes = launch_ranks(_CTX, run_rank, 2, lambda rank, port: (
        scenario, {"runs": str(runs), "dcp": str(tmp / "dcp"), "out": str(out)}, rank, 2,
        port), 180)
    assert codes == [0, 0]
    return runs / "rs", [torch.load(out / f"saved_rank{r}.pt", weights_only=False)
                         for r in range(2)]


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.exists() else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        got = load_file(str(folder / f))
        assert not set(got) & set(out)
        out.update(got)
    if index.exists():  # the index names the file each tensor is in
        wm = json.loads(index.read_text())["weight_map"]
        assert {n: f for f in files for n in load_file(str(folder / f))} == wm
    return out


def test_sharded_model_and_optimizer_export_as_full_tensors(tmp_path: Path) -> None:
    run, saved = _save(tmp_path, "save")
    full = saved[0]["full"]
    res = export_hf(run, tmp_path / "one")
    assert res.shards == ["model.safetensors"]
    got = _exported(tmp_path / "one")
    assert set(got) == {"w0", "w1", "b"}
    for name, t in got.items():
        assert torch.equal(t, full[name]), name
    # one file per tensor (bf16: b 6 bytes, w0 84, w1 40; larger than 30 bytes goes alone,
    # as it is met): each file's targets are planned and read on their own
    res = export_hf(run, tmp_path / "many", max_shard_size=30, dtype="bfloat16")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"w0": "model-00001-of-00003.safetensors",
                                   "w1": "model-00002-of-00003.safetensors",
                                   "b": "model-00003-of-00003.safetensors"}
    assert index["metadata"] == {"total_parameters": 65, "total_size": 130}
    for name, t in _exported(tmp_path / "many").items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].bfloat16()), name
    # the optimizer's sharded moments, and its replicated step counters
    opt = _exported(Path(export_hf(run, tmp_path / "opt", item="optimizer").out_dir))
    for p in ("w0", "w1", "b"):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt[f"state.{p}.{k}"], full[f"{p}.{k}"]), (p, k)


def test_fsdp2_model_exports_as_full_tensors(tmp_path: Path) -> None:
    run, saved = _save(tmp_path, "fsdp_save")
    got = _exported(Path(export_hf(run, tmp_path / "out", max_shard_size="150B").out_dir))
    params = [n for n in saved[0]["local"] if "." in n and n.count(".") == 1]
    assert set(got) == set(params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name in params:  # Shard(0) over 2 ranks: the global tensor is the ranks' rows
        want = torch.cat([saved[0]["local"][name], saved[1]["local"][name]])
        assert torch.equal(got[name], want), name
    assert got["0.weight"].shape == (5, 7)  # 5 rows: uneven on 2 ranks
