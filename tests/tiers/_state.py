"""The small model + AdamW state the one-process tier tests save, and one training step."""

from __future__ import annotations

from typing import Any

import torch

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
