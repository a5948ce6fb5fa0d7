"""Lightning CheckpointIO plugin: compressed async files, resume, errors surfaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from mithril_async.errors import SaveFailed  # noqa: E402
from mithril_async.integrations.lightning import MithrilCheckpointIO  # noqa: E402


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


def _loader() -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=8)


def _trainer(tmp: Path, steps: int, io: MithrilCheckpointIO) -> L.Trainer:
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=2,
                                               save_top_k=-1)
    return L.Trainer(max_steps=steps, plugins=[io], callbacks=[ckpt], logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1)


def test_fit_saves_compressed_files_and_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    io = MithrilCheckpointIO(compression_level=3)
    model = Tiny()
    _trainer(tmp_path, 4, io).fit(model, _loader())
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert [f.name for f in files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert all(f.read_bytes()[:4] == b"MCKP" for f in files)
    ck = io.load_checkpoint(files[-1])
    assert ck["global_step"] == 4 and ck["hyper_parameters"]["width"] == 32
    for k, v in model.state_dict().items():
        assert torch.equal(ck["state_dict"][k], v)
    # resume through Lightning's own ckpt_path
    resumed = Tiny()
    t2 = _trainer(tmp_path / "r", 6, MithrilCheckpointIO())
    t2.fit(resumed, _loader(), ckpt_path=str(files[-1]))
    assert t2.global_step == 6


def test_background_error_is_raised_by_next_call(tmp_path: Path) -> None:
    io = MithrilCheckpointIO()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    io.save_checkpoint({"w": torch.ones(3)}, blocker / "x.ckpt")  # returns at once
    with pytest.raises(SaveFailed, match=r"x\.ckpt"):
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "ok.ckpt")
    io.save_checkpoint({"w": torch.ones(3), "meta": {"a": (1, 2.5)}}, tmp_path / "ok.ckpt")
    back = io.load_checkpoint(tmp_path / "ok.ckpt")  # waits for the write
    assert torch.equal(back["w"], torch.ones(3)) and back["meta"] == {"a": (1, 2.5)}
    io.remove_checkpoint(tmp_path / "ok.ckpt")
    assert not (tmp_path / "ok.ckpt").exists()
    io.teardown()


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v


def test_pickle_fallback_is_opt_in(tmp_path: Path) -> None:
    from mithril_async.errors import InvalidFormat, UnsupportedStateType

    ck = {"state_dict": {"w": torch.arange(6.0)}, "hyper_parameters": {"obj": Opaque(3)},
          "path": Path("/x")}
    strict = MithrilCheckpointIO(asynchronous=False)
    with pytest.raises(UnsupportedStateType):
        strict.save_checkpoint(ck, tmp_path / "a.ckpt")
    io = MithrilCheckpointIO(pickle_fallback=True)
    io.save_checkpoint(ck, tmp_path / "a.ckpt")
    back = io.load_checkpoint(tmp_path / "a.ckpt")
    assert back["hyper_parameters"]["obj"].v == 3 and back["path"] == Path("/x")
    assert torch.equal(back["state_dict"]["w"], torch.arange(6.0))
    with pytest.raises(InvalidFormat, match="allow_pickle"):
        strict.load_checkpoint(tmp_path / "a.ckpt")
    io.teardown()
