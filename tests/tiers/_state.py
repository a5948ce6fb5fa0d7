"""The small model + AdamW state the one-process tier tests save, one training step, the run's
config (run ``r1``) and bitwise snapshots of the state."""

from __future__ import annotations

from typing import Any

import torch

from mithril_async import parse_config
from tests.manager.conftest import TinyNet


def tiny_state(seed: int, d: int = 8) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = TinyNet(d=d, vocab=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt}


def train_step(state: dict[str, Any]) -> None:
    loss = state["model"](torch.arange(12).reshape(2, 6) % 16).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()


def run_config() -> Any:
    return parse_config('[checkpointing]\nruns_path = "runs"\nrun_id = "r1"\n'
                        "[checkpointing.compression]\nthreads = 1\n")


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of every model and optimizer tensor, by name."""
    out = {f"m.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optimizer"].state.values()):
        out.update({f"o{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tier_config(table: dict[str, Any], config: Any = None) -> Any:
    """``config`` (default: :func:`run_config`) with ``table`` as its
    ``[checkpointing.tiers]``."""
    from mithril_async.tiers import TiersConfig

    config = (config or run_config()).model_copy(deep=True)
    config.checkpointing.tiers = TiersConfig.from_mapping(table)
    return config


def tiered(table: dict[str, Any], state: dict[str, Any], remote: Any = None, **kw: Any) -> Any:
    """A manager of run ``r1`` saving and restoring through the tiers ``table`` describes,
    ``remote`` as its remote tier."""
    from mithril_async import CheckpointManager

    return CheckpointManager(tier_config(table), state, tier_remote=remote, **kw)
