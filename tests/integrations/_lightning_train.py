"""A tiny Lightning run for the plugin's tests, importable and runnable as a child process.

As a script (``python _lightning_train.py DIR MODE MARKER``) it trains with
``MithrilCheckpointIO(asynchronous=MODE == "async")``, saving every 2 steps plus ``last.ckpt``,
and stalls the write of the step-6 top-k file half-way: it writes half the encoded bytes to
the temp file, creates ``MARKER`` and sleeps, so the parent can SIGKILL it mid-write at a
known point (no timing involved).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch


class Tiny(L.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(n: int = 64) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=8)


def trainer(dirpath: Path, io: Any, *, max_steps: int = -1, max_epochs: int | None = None,
            callbacks: list[Any] | None = None, **ckpt: Any) -> L.Trainer:
    """A quiet CPU trainer whose ModelCheckpoint writes into ``dirpath``."""
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=dirpath, **ckpt)
    return L.Trainer(max_steps=max_steps, max_epochs=max_epochs,
                     plugins=[io] if io is not None else None,
                     callbacks=[cb, *(callbacks or [])], logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1, num_sanity_val_steps=0)


def _main(folder: str, mode: str, marker: str) -> None:
    import mithril_async.integrations.lightning as ml
    import mithril_async.integrations.lightning_files as lf

    original = lf.write_all

    def stalling(fd: int, data: Any) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(".tmp-epoch=0-step=6.ckpt"):
            original(fd, memoryview(data)[:len(data) // 2])
            Path(marker).touch()
            time.sleep(600)  # the parent kills us here
        original(fd, data)

    lf.write_all = stalling  # type: ignore[assignment]
    torch.manual_seed(0)
    io = ml.MithrilCheckpointIO(asynchronous=mode == "async")
    trainer(Path(folder), io, max_steps=8, every_n_train_steps=2, save_top_k=-1,
            save_last=True).fit(Tiny(), loader())


if __name__ == "__main__":
    _main(*sys.argv[1:4])
