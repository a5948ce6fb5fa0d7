"""State dicts as PyTorch users write them: plain dicts and lists of tensors and values as
state entries, no ``model`` entry required, restored into the very objects the user holds.

Each case runs with saves in the training process and in the checkpoint worker (the
default), since the worker receives these entries as any other item's staged snapshot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mithril_async import CheckpointManager
from mithril_async.cli import main as cli_main
from mithril_async.config import Config, config_from_dict
from mithril_async.errors import (
    ConfigError,
    ShapeMismatch,
    UnsupportedStateType,
    VersionNotFound,
)

PROCESSES = pytest.mark.parametrize("process", ["inline", "worker"])


def _cfg(tmp_path: Path, process: str) -> Config:
    return config_from_dict({"checkpointing": {
        "runs_path": str(tmp_path / "runs"), "run_id": "plain",
        "pipeline": {"process": process}, "compression": {"delta": True}}})


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g).bfloat16()}


@PROCESSES
def test_a_dict_of_tensors_alone_saves_and_restores_in_place(tmp_path: Path,
                                                             process: str) -> None:
    """No ``model`` entry: ``{"weights": {...}}`` is a whole state; a restore writes into
    the same tensor objects the user holds."""
    state: dict[str, Any] = {"weights": _weights(0)}
    held = state["weights"]["w"]  # what the training code holds
    with CheckpointManager(_cfg(tmp_path, process), state) as mgr:
        assert mgr.process == process
        saved = {k: v.clone() for k, v in state["weights"].items()}
        assert mgr.save_nowait(1).result().status == "committed"
        for t in state["weights"].values():
            t.add_(1)
        assert mgr.save_nowait(2).result().status == "committed"
        assert mgr.restore_sync(1) == 1
    assert state["weights"]["w"] is held  # in place: the same object
    for k, v in saved.items():
        assert state["weights"][k].dtype == v.dtype and torch.equal(state["weights"][k], v)
    man = json.loads((tmp_path / "runs/plain/versions/v000001/manifest.json").read_text())
    assert "model" not in man and "weights" in man["extra"]
    assert cli_main(["ls", str(tmp_path / "runs/plain")]) == 0
    assert cli_main(["verify", str(tmp_path / "runs/plain")]) == 0


@PROCESSES
def test_values_beside_a_model_are_written_back_into_the_state(tmp_path: Path,
                                                               process: str) -> None:
    """``{"model": m, "step": 5, "extra": {...}}``: the model loads as always; the step,
    the extra dict's numbers, strings, bytes, None and nested lists come back into the
    dicts and lists the user holds."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    extra: dict[str, Any] = {"ema": torch.zeros(3), "count": 7, "lr": 0.125, "name": "run",
                             "blob": b"\x00\xffbytes", "none": None,
                             "history": [1.5, {"t": torch.ones(2), "k": [1, 2]}],
                             "arr": np.arange(4, dtype=np.int32)}
    state: dict[str, Any] = {"model": model, "step": 5, "extra": extra}
    with CheckpointManager(_cfg(tmp_path, process), state) as mgr:
        assert mgr.process == process
        mgr.save_nowait(5).result()
        want_w = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        state["step"] = 99
        extra.update(count=0, lr=1.0, name="x", blob=b"", none=3)
        extra["ema"].fill_(4.0)
        extra["history"][0] = -1.0
        extra["history"][1]["t"].zero_()
        extra["history"][1]["k"].append(3)  # a list that changed length...
        with pytest.raises(ShapeMismatch, match=r"extra/history/1/k"):
            mgr.restore_sync(5)  # ...is refused naming it, before any value is written back
        assert state["step"] == 99 and extra["count"] == 0 and extra["name"] == "x"
        extra["history"][1]["k"].pop()
        assert mgr.restore_sync(5) == 5
    assert torch.equal(model.weight, want_w)
    assert state["step"] == 5
    assert extra["count"] == 7 and extra["lr"] == 0.125 and extra["name"] == "run"
    assert extra["blob"] == b"\x00\xffbytes" and extra["none"] is None
    assert torch.equal(extra["ema"], torch.zeros(3))
    assert extra["history"][0] == 1.5 and torch.equal(extra["history"][1]["t"], torch.ones(2))
    assert extra["history"][1]["k"] == [1, 2]
    assert np.array_equal(extra["arr"], np.arange(4, dtype=np.int32))


class _Opaque:
    pass


def test_what_cannot_be_stored_is_refused_naming_its_key(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "inline")
    with pytest.raises(UnsupportedStateType, match=r"state\['obj'\].*_Opaque"):
        CheckpointManager(cfg, {"weights": _weights(0), "obj": _Opaque()})
    with pytest.raises(UnsupportedStateType, match="state key 3"):
        CheckpointManager(cfg, {3: _weights(0)})  # type: ignore[dict-item]
    state = {"extra": {"ok": 1, "tags": {"a", "b"}}}  # a set: no JSON form, never pickled
    with CheckpointManager(cfg, state) as mgr:
        with pytest.raises(UnsupportedStateType, match=r"state\['extra'\].*'tags'.*no pickle"):
            mgr.save_nowait(1)
        assert mgr.all_steps() == []
    with CheckpointManager(cfg, {"weights": _weights(0)}) as mgr:
        mgr.save_nowait(1).result()
        with pytest.raises(ConfigError, match="has none"):
            mgr.restore_sync(1, load="model")
    # a live entry the version does not hold: a typed error naming it, nothing reported done
    with CheckpointManager(cfg, {"weights": _weights(1), "model": torch.nn.Linear(2, 2)}
                           ) as mgr, pytest.raises(VersionNotFound, match="'model'"):
        mgr.restore_sync(1)


def test_a_tensor_of_another_shape_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "inline")
    state = {"weights": _weights(0)}
    with CheckpointManager(cfg, state) as mgr:
        mgr.save_nowait(1).result()
    other = {"weights": {"w": torch.zeros(4, 8), "b": torch.zeros(4).bfloat16()}}
    with CheckpointManager(cfg, other) as mgr, pytest.raises(ShapeMismatch, match=r"weights"):
        mgr.restore_sync(1)
    assert torch.equal(other["weights"]["b"], torch.zeros(4).bfloat16())
