"""A small deterministic model for the worker tests: ``expected(step)`` is exactly what a
run saved at ``step`` holds."""

from __future__ import annotations

import torch


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def expected(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=g)
            for name, p in make_model().named_parameters()}
