"""Shared pieces of the CUDA tests: a small real model on the device, a resumable batch
source, one training step that never synchronizes, and a way to widen the device-side race
windows without any timing assert.

Every module of tests/gpu sets ``pytestmark = CUDA_ONLY``: marked ``cuda`` (``pytest -m cuda``
selects them; ``make gpu-check`` runs them) and skipped, with the reason below, where
``torch.cuda.is_available()`` is false (CI and the development machines have no GPU).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mithril_async.device import CudaCopier

HAS_CUDA = torch.cuda.is_available()
CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is "
                       "false): the CUDA tests run on a GPU machine via `make gpu-check`"),
]
DEV = "cuda"

#: Cycles of ``torch.cuda._sleep`` put on the stager's side stream before its copies: ~25 ms
#: at H100/H200 clocks. It does not make any test pass or fail by timing; it only makes sure
#: that a step queued right after ``save()`` really is on the device while the copies are
#: still pending, so a missing stream/event order would tear the snapshot.
SIDE_STREAM_SLEEP = 50_000_000


class CudaNet(nn.Module):
    """LayerNorm + a stack of Linear/GELU + a head, plus ``calls``, a buffer every forward
    changes in place on the device (like batch-norm statistics)."""

    def __init__(self, width: int = 256, layers: int = 2, out: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(layers)])
        self.head = nn.Linear(width, out)
        self.register_buffer("calls", torch.zeros(4096))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.head(self.body(self.norm(x)))


class DeviceBatcher:
    """A resumable data source (``get_state`` / ``set_state``): batch ``i`` is drawn from a CPU
    generator seeded by ``i``, then moved to the device."""

    def __init__(self, width: int = 256, out: int = 32, batch: int = 16) -> None:
        self.width, self.out, self.batch = width, out, batch
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        x = torch.randn(self.batch, self.width, generator=g)
        y = torch.randint(0, self.out, (self.batch,), generator=g)
        return x.to(DEV), y.to(DEV)

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def make_cuda_state(seed: int = 0, width: int = 256, layers: int = 2, *, fused: bool = False
                    ) -> tuple[CudaNet, torch.optim.Optimizer, DeviceBatcher]:
    """Model and AdamW on the device (``fused``: the fused kernel, whose ``step`` counters
    live on the device too; otherwise the default foreach kernels, ``step`` on the host)."""
    torch.manual_seed(seed)
    model = CudaNet(width, layers).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    return model, opt, DeviceBatcher(width)


def train_step(model: CudaNet, opt: torch.optim.Optimizer, batcher: DeviceBatcher
               ) -> torch.Tensor:
    """One step, queued on the current stream; nothing here waits for the device. Noise
    from the device RNG makes the RNG restore matter for an exact resume."""
    x, y = batcher.next()
    logits = model(x)
    noise = torch.randn(logits.shape, device=logits.device) * 1e-3
    loss = nn.functional.cross_entropy(logits + noise, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def live(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of the live state, made on the current stream (so it is ordered exactly
    where a ``save()`` called next would see the state)."""
    return {"model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(opt.state_dict())}


def slow_side_stream(monkeypatch: pytest.MonkeyPatch, cycles: int = SIDE_STREAM_SLEEP) -> None:
    """Queue a device-side sleep on the staging copier's side stream ahead of every batch of
    device-to-host copies (after the stream is ordered behind the producer's work)."""
    real = CudaCopier.queue

    def slow(self: CudaCopier, items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)
        return real(self, items)

    monkeypatch.setattr(CudaCopier, "queue", slow)
