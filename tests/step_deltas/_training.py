"""A tiny real training run shared by the delta tests (no downloads, a few ms per step)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding -> MLP -> head, with a frozen projection that must never change."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.mlp(self.frozen(h))
        return self.head(self.norm(h))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    raise ValueError(kind)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    after_step: Callable[[int], None],
    seed: int = 0,
) -> None:
    """``steps`` optimizer steps of next-token prediction on random tokens (few distinct
    tokens per batch, so SGD leaves most embedding rows untouched)."""
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 64, (2, 6), generator=g)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        after_step(step)


def snapshot(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype=dtype, copy=True) for k, v in model.named_parameters()}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))
