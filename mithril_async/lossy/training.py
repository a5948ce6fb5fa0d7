"""Flatten a model + Adam/AdamW optimizer into named tensors with lossy-delta roles, and back.

Why: the lossy delta tier needs to know which tensor is a weight and which are that weight's
first/second moments (joint pruning, Fisher weighting). Names are stable
(``model/<param>``, ``optim/<param>/exp_avg``, ...), so chains stay aligned across saves.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mithril_async.errors import ShapeMismatch
from mithril_async.lossy.excp import Role

__all__ = ["adam_state", "load_adam_state"]


def adam_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, Role]]]:
    """Snapshot (copies) of parameters and Adam moments, plus their roles."""
    state: dict[str, torch.Tensor] = {}
    roles: dict[str, tuple[str, Role]] = {}
    for pname, p in model.named_parameters():
        state[f"model/{pname}"] = p.detach().clone()
        roles[f"model/{pname}"] = (pname, "param")
        st = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                state[f"optim/{pname}/{key}"] = st[key].detach().clone()
                role: Role = "exp_avg" if key == "exp_avg" else "exp_avg_sq"
                roles[f"optim/{pname}/{key}"] = (pname, role)
        if "step" in st:
            step = st["step"]
            state[f"optim/{pname}/step"] = (step.detach().clone() if isinstance(step, torch.Tensor)
                                            else torch.tensor(float(step)))
    for bname, b in model.named_buffers():
        state[f"buffer/{bname}"] = b.detach().clone()
    return state, roles


def load_adam_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: Mapping[str, torch.Tensor]) -> None:
    """Copy a snapshot made by :func:`adam_state` back into live tensors."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            src = state[f"model/{pname}"]
            if src.shape != p.shape:
                raise ShapeMismatch(f"model/{pname}: {tuple(src.shape)} != {tuple(p.shape)}")
            p.copy_(src)
            if f"optim/{pname}/step" not in state:
                continue
            st = optimizer.state[p]
            st["step"] = state[f"optim/{pname}/step"].clone()
            for key in ("exp_avg", "exp_avg_sq"):
                st[key] = state[f"optim/{pname}/{key}"].clone().to(p.dtype)
        for bname, b in model.named_buffers():
            b.copy_(state[f"buffer/{bname}"])
