"""The non-finite guard through a real CheckpointManager: a version whose tensors hold NaN or
Inf never becomes ``latest`` (``nonfinite = "hold"``), or is not committed at all
(``"fail"``); tensors the run allows are only counted.

Why: a diverged run must not restart into NaNs from ``latest``, and nothing may be lost
either: a held version is committed and restorable by its id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import (
    CheckpointManager,
    Config,
    NonFiniteState,
    SaveFailed,
    TensorDict,
)
from mithril_async.catalog import open_catalog
from mithril_async.cli import main as cli

ConfigFactory = Callable[..., Config]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(64, generator=g).bfloat16(),
            "steps": torch.arange(10)}


def _run(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "run1"


def _manifest(tmp_path: Path, vid: str) -> dict[str, Any]:
    return json.loads((_run(tmp_path) / "versions" / vid / "manifest.json").read_text())


def _nans(t: torch.Tensor) -> int:
    return int(t.float().isnan().sum())


@pytest.mark.parametrize("compress", [True, False])
def test_held_version_commits_but_no_alias_moves_to_it(
        make_config: ConfigFactory, tmp_path: Path, compress: bool,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n",
                      best_metric_name="loss")
    sd = _state()
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        assert m.save_nowait(1, {"loss": 1.0}).result().held is False
        sd["w"][[5, 4000]] = float("nan")
        sd["b"][3] = float("-inf")
        with caplog.at_level(logging.WARNING, "mithril_async"):
            res = m.save_nowait(2, {"loss": 0.5}).result()  # a better metric, even
        assert (res.status, res.version_id, res.held) == ("committed", "v000002", True)
        assert res.nonfinite == {"model/b": (0, 1), "model/w": (2, 0)}
        warned = [r.getMessage() for r in caplog.records if "v000002" in r.getMessage()]
        assert warned and "item model, tensor w: 2 NaN, 0 Inf" in warned[0]
        assert (m.latest_step(), m.best_step()) == (1, 1)

        healthy, held = _manifest(tmp_path, "v000001"), _manifest(tmp_path, "v000002")
        assert "held" not in healthy and "nonfinite" not in healthy["model"]  # as before
        assert held["held"] is True
        assert held["model"]["nonfinite"] == {"model/b": {"nan": 0, "inf": 1},
                                              "model/w": {"nan": 2, "inf": 0}}
        run_json = json.loads((_run(tmp_path) / "run.json").read_text())
        assert [v.get("held", False) for v in run_json["versions"]] == [False, True]

        sd["w"].zero_()
        assert m.restore_sync("latest") == 1  # the newest healthy version
        assert _nans(sd["w"]) == 0 and _nans(sd["b"]) == 0
        assert m.restore_sync("v000002") == 2  # an explicit restore still loads it
        assert _nans(sd["w"]) == 2 and bool(sd["b"][3].float().isneginf())

        sd["w"].nan_to_num_(0.0)
        sd["b"].nan_to_num_(0.0, 0.0, 0.0)
        assert m.save_nowait(3, {"loss": 0.7}).result().held is False
        assert (m.latest_step(), m.best_step()) == (3, 3)

    assert cli(["ls", str(tmp_path / "runs"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [v["held"] for v in doc["runs"][0]["versions"]] == [False, True, False]
    assert cli(["ls", str(tmp_path / "runs")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("v000002"))
    assert "held: NaN/Inf" in line
    assert cli(["inspect", str(_run(tmp_path) / "versions" / "v000002"), "--no-tensors"]) == 0
    text = capsys.readouterr().out
    assert "HELD" in text and "non-finite: model/w: 2 NaN, 0 Inf" in text
    assert cli(["inspect", str(_run(tmp_path)), "--version", "v000002", "--json",
                "--no-tensors"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["held"] and doc["nonfinite"]["model/b"] == {"nan": 0, "inf": 1}


@pytest.mark.parametrize("compress", [True, False])
def test_streamed_saves_count_too(make_config: ConfigFactory, compress: bool) -> None:
    """A state bigger than host_memory_mib is copied out chunk by chunk into ring slots:
    those chunks are counted as they are encoded (or hashed, uncompressed)."""
    cfg = make_config(f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n"
                      "chunk_mib = 1\n[checkpointing.pipeline]\nhost_memory_mib = 10\n")
    sd = {"w": torch.zeros(3 << 20)}  # 12 MiB
    sd["w"][[0, (3 << 20) - 1]] = float("nan")
    sd["w"][1 << 20] = float("-inf")
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        res = m.save_nowait(1).result()
    assert res.streamed and res.held and res.nonfinite == {"model/w": (2, 1)}


def test_aliases_and_start_up_repair_never_point_at_a_held_version(
        make_config: ConfigFactory, tmp_path: Path) -> None:
    sd = _state()
    with CheckpointManager(make_config(), {"model": TensorDict(sd)}) as m:
        m.save_nowait(1).result()
        sd["w"][0] = float("inf")
        assert m.save_nowait(2).result().held
    # a writer killed between its manifest and its alias moves: the start-up repair moves
    # latest to the newest version that is not held
    (_run(tmp_path) / "aliases" / "latest.json").unlink()
    with CheckpointManager(make_config(), {"model": TensorDict(_state())}) as m:
        assert m.latest_step() == 1
    cat = open_catalog(tmp_path / "runs", "run1")
    held = asyncio.run(cat.read_manifest(cat.layout.manifest_key(2)))
    healthy = asyncio.run(cat.read_manifest(cat.layout.manifest_key(1)))
    key = cat.layout.manifest_key
    # the tiers' aliases (latest_local, latest_remote, ...) go through move_alias
    assert asyncio.run(cat.move_alias("latest_local", held, key(2))) is False
    assert asyncio.run(cat.move_alias("latest_local", healthy, key(1))) is True
    assert asyncio.run(cat.read_alias("latest_local")).version_id == "v000001"


def test_fail_commits_nothing_and_the_next_healthy_save_does(make_config: ConfigFactory,
                                                            tmp_path: Path) -> None:
    sd = _state()
    with CheckpointManager(make_config(nonfinite="fail"), {"model": TensorDict(sd)}) as m:
        m.save_nowait(1).result()
        sd["w"][7] = float("inf")
        with pytest.raises(NonFiniteState) as err:
            m.save_nowait(2).result()
        assert isinstance(err.value, ValueError)
        assert "item model, tensor w: 0 NaN, 1 Inf" in str(err.value)
        assert err.value.tensors == {"model/w": (0, 1)}
        with pytest.raises(SaveFailed) as failed:  # reported like every failed save
            m.check_for_errors()
        assert isinstance(failed.value.__cause__, NonFiniteState)
        assert m.all_steps() == [1] and m.latest_step() == 1
        assert m.history[-1].status == "failed" and m.history[-1].nonfinite == {
            "model/w": (0, 1)}
        sd["w"][7] = 0.0
        res = m.save_nowait(3).result()
        assert (res.status, res.held) == ("committed", False)
        assert m.all_steps() == [1, 3] and m.latest_step() == 3
    assert not (_run(tmp_path) / "versions" / res.version_id / "manifest.json").read_text(
    ).count("nonfinite")


def test_allowed_tensors_are_counted_but_never_hold(make_config: ConfigFactory,
                                                   tmp_path: Path) -> None:
    sd = {**_state(), "attn_mask": torch.full((8, 8), float("-inf")).triu(1)}
    cfg = make_config(nonfinite_allow=["model/attn_*"])
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        res = m.save_nowait(1).result()
        assert (res.held, res.nonfinite, m.latest_step()) == (False, {}, 1)
        assert _manifest(tmp_path, "v000001")["model"]["nonfinite"] == {
            "model/attn_mask": {"nan": 0, "inf": 28, "allowed": True}}
        sd["w"][1] = float("nan")  # the glob allows the mask, not the weights
        res = m.save_nowait(2).result()
        assert (res.held, res.nonfinite, m.latest_step()) == (True, {"model/w": (1, 0)}, 1)
    # "allow": counted and reported, nothing held
    cfg = make_config(nonfinite="allow")
    cfg.checkpointing.run_id = "run2"
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        res = m.save_nowait(1).result()
        assert res.held is False and res.nonfinite["model/w"] == (1, 0)
        assert m.latest_step() == 1


def test_delta_chain_with_nan_entering_and_leaving(make_config: ConfigFactory,
                                                  tmp_path: Path) -> None:
    """Deltas count the values, not their XOR with the base; a tensor stored once and then
    only referenced (dedup) keeps its counts in every later version."""
    cfg = make_config("[checkpointing.compression]\ndelta = true\nkeyframe_interval = 8\n"
                      "delta_min_gain = 0.0\n", nonfinite_allow=["model/frozen"])
    g = torch.Generator().manual_seed(1)
    sd = {"w": torch.randn(8192, generator=g), "frozen": torch.randn(4096, generator=g)}
    sd["frozen"][[1, 2, 3]] = float("inf")
    held, truth = [], []
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        for step in range(1, 6):
            sd["w"] += 1e-3
            if step == 3:
                sd["w"][[10, 11]] = float("nan")
            if step == 4:
                sd["w"][[10, 11]] = 0.5
            res = m.save_nowait(step).result()
            held.append(res.held)
            truth.append(sd["w"].clone())
            assert res.nonfinite == ({"model/w": (2, 0)} if step == 3 else {})
        assert held == [False, False, True, False, False]
        assert m.latest_step() == 5
        mans = [_manifest(tmp_path, f"v00000{i}") for i in range(1, 6)]
        assert all(mf["model"]["base"] for mf in mans[1:])  # deltas, v4's against held v3
        assert mans[3]["model"]["base"]["version_id"] == "v000003"
        assert all(mf["model"]["refs"] for mf in mans[1:])  # frozen: referenced
        for mf in mans:
            assert mf["model"]["nonfinite"]["model/frozen"] == {"nan": 0, "inf": 3,
                                                                "allowed": True}
        for step in (3, 4, 5):
            sd["w"].zero_()
            m.restore_sync(f"v00000{step}")
            assert torch.equal(sd["w"].nan_to_num(7.0), truth[step - 1].nan_to_num(7.0))
        assert m.restore_sync("latest") == 5


LOSSY = """[checkpointing.lossy]
enabled = true
density = 0.1
keyframe_every = 4
"""


def test_lossy_tensors_are_counted_before_quantisation(make_config: ConfigFactory,
                                                       tmp_path: Path) -> None:
    """A NaN in a lossily coded weight holds the version; the NaN cannot be quantised, so
    that version stores it exactly and the lossy chain restarts after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(make_config(LOSSY), {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        with torch.no_grad():
            model[0].weight[3, 3] = float("nan")
        res = m.save_nowait(2).result()
        assert (res.held, res.nonfinite) == (True, {"model/0.weight": (1, 0)})
        man = _manifest(tmp_path, "v000002")
        assert man["lossy"]["shards"][0]["nonfinite"] == {"model/0.weight": {"nan": 1,
                                                                             "inf": 0}}
        assert "model/0.weight" in man["lossy"]["tensors"]  # still the lossy blob's
        assert m.latest_step() == 1
        assert m.restore_sync("v000002") == 2
        assert math.isnan(float(model[0].weight[3, 3].detach()))
        with torch.no_grad():
            model[0].weight[3, 3] = 0.25
        assert m.save_nowait(3).result().held is False
        assert _manifest(tmp_path, "v000003")["lossy"]["keyframe"] is True  # restarted
        assert m.latest_step() == 3
        model[0].weight.data.zero_()
        assert m.restore_sync("latest") == 3
        assert not model[0].weight.isnan().any()


def test_worker_process_reports_the_counts(make_worker_config: ConfigFactory) -> None:
    sd = _state()
    with CheckpointManager(make_worker_config(), {"model": TensorDict(sd)}) as m:
        assert m.process == "worker"
        m.save_nowait(1).result()
        sd["w"][9] = float("nan")
        res = m.save_nowait(2).result()
        assert (res.held, res.nonfinite) == (True, {"model/w": (1, 0)})
        assert m.latest_step() == 1


@pytest.mark.parametrize("process", ["inline", "worker"])
def test_complex_nan_and_inf_hold_the_version(
        make_config: ConfigFactory, make_worker_config: ConfigFactory, process: str) -> None:
    """NaN in one part of a complex element and Inf in the other are counted (one each), so
    the version is held and ``latest`` stays on the healthy one, inline and in a worker.
    (Uncompressed safetensors blobs cannot hold complex tensors.)"""
    cfg = (make_worker_config if process == "worker" else make_config)()
    sd = {"z": torch.zeros(512, dtype=torch.complex64),
          "zz": torch.zeros(64, dtype=torch.complex128), "w": torch.ones(256)}
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        assert m.process == process
        assert m.save_nowait(1).result().held is False
        sd["z"][7] = complex(float("nan"), float("inf"))
        sd["zz"][1] = complex(float("-inf"), 2.0)
        res = m.save_nowait(2).result()
        assert (res.status, res.held) == ("committed", True)
        assert res.nonfinite == {"model/z": (1, 1), "model/zz": (0, 1)}
        assert m.latest_step() == 1


def test_config_keys_are_checked(make_config: ConfigFactory) -> None:
    assert make_config().checkpointing.nonfinite == "hold"
    with pytest.raises(ValueError, match="nonfinite"):
        make_config(nonfinite="ignore")
    with pytest.raises(ValueError, match="nonfinite_allow"):
        make_config(nonfinite_allow=[""])
