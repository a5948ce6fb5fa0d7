"""Shared helpers: a tiny real model trained for a few steps, and a config factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import Config, parse_config


class TinyNet(torch.nn.Module):
    def __init__(self, d: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, vocab))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(self.emb(x)))


class FakeEvent:
    """A torch.cuda.Event stand-in: completes after ``polls`` queries or a synchronize(),
    like an event behind queued device-to-host copies."""

    def __init__(self, polls: int = 3) -> None:
        self.left = polls
        self.synchronized = False

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.synchronized, self.left = True, -1


class Batcher:
    """A resumable data source (seed 002 get_state/set_state) driven by its own RNG."""

    def __init__(self, vocab: int = 64, exact: bool = True) -> None:
        self.position = 0
        self.exact = exact
        self.vocab = vocab

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        return torch.randint(0, self.vocab, (8, 16), generator=g)

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position, "exact": self.exact}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def train_step(model: TinyNet, opt: torch.optim.Optimizer, batcher: Batcher) -> float:
    x = batcher.next()
    logits = model(x)
    # dropout-like noise from the global RNG, so RNG restore matters for exact resume
    noise = torch.randn(logits.shape) * 1e-3
    loss = torch.nn.functional.cross_entropy((logits + noise).reshape(-1, logits.shape[-1]),
                                             x.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def make_state(seed: int = 0) -> tuple[TinyNet, torch.optim.Optimizer, Batcher]:
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, Batcher()


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., Config]:
    def factory(extra: str = "", **kw: Any) -> Config:
        lines = [f'runs_path = "{tmp_path / "runs"}"', 'run_id = "run1"',
                 "ckpting_save_iter = 1"]
        lines += [f"{k} = {v!r}" if not isinstance(v, bool) else f"{k} = {str(v).lower()}"
                  for k, v in kw.items()]
        text = "[checkpointing]\n" + "\n".join(lines).replace("'", '"') + "\n" + extra
        return parse_config(text)

    return factory


def state_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, dict):
            if not (isinstance(y, dict) and state_equal(x, y)):
                return False
        elif isinstance(x, (list, tuple)):
            if len(x) != len(y) or not all(
                state_equal({"v": p}, {"v": q}) for p, q in zip(x, y, strict=True)):
                return False
        elif x != y:
            return False
    return True


@pytest.fixture
def make_worker_config(make_config: Callable[..., Config],
                       monkeypatch: pytest.MonkeyPatch) -> Callable[..., Config]:
    """``make_config`` with the background part of saves in a checkpoint worker process, as
    the default gives it (``MITHRIL_PROCESS=worker`` while the config is built, no ``process``
    key): what a worker cannot serve (a store passed in, ...) runs inline, as by default."""
    def factory(extra: str = "", **kw: Any) -> Config:
        with monkeypatch.context() as env:
            env.setenv("MITHRIL_PROCESS", "worker")
            cfg = make_config(extra, **kw)
        assert not cfg.checkpointing.pipeline.worker_required
        return cfg

    return factory
