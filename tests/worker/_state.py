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


def set_step(model: torch.nn.Module, step: int) -> None:
    """Give ``model`` (from :func:`make_model`) exactly the values of ``step``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected(step)[name])


def holds_step(model: torch.nn.Module, step: int) -> bool:
    """Whether ``model`` holds exactly the values of ``step``."""
    return all(torch.equal(p, expected(step)[n]) for n, p in model.named_parameters())
