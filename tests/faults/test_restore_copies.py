"""A restore must reach the live parameters even when a state dict exports copies.

The in-place restore decodes straight into the tensors ``state_dict()`` returns and skips
``load_state_dict`` when that was the whole module: right for a plain module (its state dict
holds views of the live parameters), silently wrong for one whose state dict holds copies
(a module converting dtypes in ``_save_to_state_dict``, a state-dict hook returning new
tensors, FSDP1's gathered full state dict). Each case saves one state, changes the live
weights, restores, and checks the live parameters hold the saved bytes.
"""

from __future__ import annotations

import functools
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, TensorDict
from mithril_async.config import config_from_dict
from tests.ranks import launch_ranks


def _config(tmp: Path, compression: bool = True) -> Any:
    return config_from_dict({"checkpointing": {
        "runs_path": str(tmp / "runs"), "run_id": "copies",
        "compression": {"enabled": compression}}})


class Bf16Storage(torch.nn.Module):
    """Keeps its weight in bf16 and exports/imports it as fp32 through the documented
    ``_save_to_state_dict`` / ``_load_from_state_dict`` extension points."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
        self.lin = torch.nn.Linear(64, 8)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight.detach().float()
        self.lin._save_to_state_dict(destination, prefix + "lin.", keep_vars)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any
                              ) -> None:
        with torch.no_grad():
            self.weight.copy_(state_dict[prefix + "weight"].to(torch.bfloat16))
        self.lin._load_from_state_dict(state_dict, prefix + "lin.", *args)

    def _load_state_dict_pre_hook(self, *a: Any) -> None:  # pragma: no cover
        pass


def _hooked_linear() -> torch.nn.Module:
    """A module whose state-dict hook replaces every tensor with a new one."""
    m = torch.nn.Linear(32, 16)

    def clone_all(module: torch.nn.Module, sd: dict[str, Any], prefix: str,
                  local_metadata: Any) -> dict[str, Any]:
        return {k: v.clone() for k, v in sd.items()}

    m._register_state_dict_hook(clone_all)
    return m


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _scramble(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _roundtrip(tmp: Path, model: torch.nn.Module, compression: bool = True
               ) -> dict[str, torch.Tensor]:
    """Save the model, change it, restore; return what was saved."""
    saved = _params(model)
    with CheckpointManager(_config(tmp, compression), {"model": model}) as mgr:
        mgr.save_nowait(1)
        mgr.wait()
    _scramble(model)
    with CheckpointManager(_config(tmp, compression), {"model": model}) as mgr:
        assert mgr.restore_sync("latest") == 1
    return saved


@pytest.mark.parametrize("compression", [True, False], ids=["mckp", "safetensors"])
@pytest.mark.parametrize("make", [Bf16Storage, _hooked_linear], ids=["dtype-export", "hook"])
def test_restore_reaches_parameters_behind_a_copying_state_dict(
        tmp_path: Path, make: Any, compression: bool) -> None:
    model = make()
    saved = _roundtrip(tmp_path, model, compression)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), f"{name} kept its scrambled value"


@pytest.mark.parametrize("compression", [True, False], ids=["mckp", "safetensors"])
def test_a_plain_model_keeps_the_in_place_path(tmp_path: Path, compression: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[torch.nn.Module] = []
    original = torch.nn.Module.load_state_dict

    @functools.wraps(original)  # keeps torch's name and module: it is torch's method
    def counting(self: torch.nn.Module, *a: Any, **kw: Any) -> Any:
        loads.append(self)
        return original(self, *a, **kw)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    saved = _params(model)
    with CheckpointManager(_config(tmp_path, compression), {"model": model}) as mgr:
        mgr.save_nowait(1)
        mgr.wait()
    _scramble(model)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", counting)
    with CheckpointManager(_config(tmp_path, compression), {"model": model}) as mgr:
        mgr.restore_sync("latest")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name])
        assert p.data_ptr() == pointers[name]
    assert loads == []  # decoded into the parameters themselves: nothing loaded again


class _ExtraState(torch.nn.Linear):
    """Module state outside its tensors (``get_extra_state``) must be loaded too."""

    def __init__(self) -> None:
        super().__init__(16, 16)
        self.calls = 0

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = int(state["calls"])


def test_extra_state_of_an_in_place_module_is_loaded(tmp_path: Path) -> None:
    model = _ExtraState()
    model.calls = 7
    saved = _params(model)
    with CheckpointManager(_config(tmp_path), {"model": model}) as mgr:
        mgr.save_nowait(1)
        mgr.wait()
    _scramble(model)
    model.calls = 0
    with CheckpointManager(_config(tmp_path), {"model": model}) as mgr:
        mgr.restore_sync("latest")
    assert model.calls == 7
    assert all(torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters())


def test_tensordict_values_restored(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    extra = TensorDict({"ema": torch.randn(8, 8)})
    want = extra.state_dict()["ema"].clone()
    with CheckpointManager(_config(tmp_path), {"model": model, "ema": extra}) as mgr:
        mgr.save_nowait(1)
        mgr.wait()
    extra.state_dict()["ema"].add_(3.0)
    with CheckpointManager(_config(tmp_path), {"model": model, "ema": extra}) as mgr:
        mgr.restore_sync("latest")
    assert torch.equal(extra.state_dict()["ema"], want)


# ------------------------------------------------------------ FSDP1, full state dict
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "mithril_async", "tests.faults.test_restore_copies"])


def _fsdp_rank(tmp: str, rank: int, world: int, port: int) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = FSDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)),
                     device_id=torch.device("cpu"))
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                 FullStateDictConfig(offload_to_cpu=True, rank0_only=False))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = _config(Path(tmp))
        with CheckpointManager(cfg, {"model": model}) as mgr:
            mgr.save_nowait(1)
            mgr.wait()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        with CheckpointManager(cfg, {"model": model}) as mgr:
            assert mgr.restore_sync("latest") == 1
        got = model.state_dict()
        bad = [k for k in saved if not torch.equal(got[k], saved[k])]
        if bad:
            raise SystemExit(f"not restored: {bad}")
    finally:
        dist.destroy_process_group()


def test_fsdp1_full_state_dict_restores_the_sharded_parameters(tmp_path: Path) -> None:
    codes = launch_ranks(_CTX, _fsdp_rank, 1, lambda rank, port: (str(tmp_path), rank, 1,
                                                                  port), timeout=120)
    assert codes == [0]
