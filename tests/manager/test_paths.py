"""Relative local paths of the configuration are resolved once, when the manager is created:
a script that changes directory afterwards still saves, exports and finds its versions where
the manager was created, inline and with the checkpoint worker (a process started at the
first save, in whatever directory the trainer is in by then)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mithril_async import CheckpointManager, parse_config
from mithril_async.config import with_absolute_paths


@pytest.mark.parametrize("process", ["inline", "worker"])
def test_a_chdir_after_creation_moves_no_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              process: str) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(home)
    cfg = parse_config('[checkpointing]\nrun_id = "r"\nexport_hf_on_close = true\n'
                       f'[checkpointing.pipeline]\nprocess = "{process}"\n')
    assert cfg.checkpointing.runs_path == "runs"  # the default, relative
    model = torch.nn.Linear(4, 3)
    mgr = CheckpointManager(cfg, {"model": model})
    try:
        monkeypatch.chdir(elsewhere)
        res = mgr.save_nowait(1).result()
        assert mgr.process == process
        if process == "worker":
            assert mgr.worker_pid is not None
        assert res.status == "committed"
        assert (home / "runs" / "r" / "versions" / str(res.version_id) / "manifest.json"
                ).is_file()
        assert mgr.latest_step() == 1
    finally:
        mgr.close()
    assert cfg.checkpointing.runs_path == "runs"  # the caller's config is left as it was
    exported = load_file(str(home / "runs" / "r" / "export" / "hf" / "model.safetensors"))
    assert torch.equal(exported["weight"], model.weight.detach())
    assert list(elsewhere.iterdir()) == []


def test_every_local_path_is_made_absolute(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = parse_config('[checkpointing]\nruns_path = "a/runs"\nexport_hf_on_close = "out"\n'
                       '[checkpointing.tiers]\nlocal = "nodes/{node}"\n')
    got = with_absolute_paths(cfg).checkpointing
    assert got.runs_path == str(tmp_path / "a" / "runs")
    assert got.export_hf_on_close == str(tmp_path / "out")
    assert got.tiers is not None and got.tiers.local == str(tmp_path / "nodes" / "{node}")
    absolute = with_absolute_paths(cfg)
    assert with_absolute_paths(absolute) is absolute
