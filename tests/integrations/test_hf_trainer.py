"""transformers.Trainer + MithrilTrainerCallback: background saves, retention, exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mithril_async.integrations.hf_trainer import MithrilTrainerCallback  # noqa: E402


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model() -> Any:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                  n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg)


def _trainer(out: Path, cb: MithrilTrainerCallback, steps: int, **kw: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8,
        learning_rate=1e-2, save_strategy=kw.pop("save_strategy", "no"),
        save_total_limit=2, logging_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=7, disable_tqdm=True, **kw)
    return transformers.Trainer(model=_model(), args=args, train_dataset=Data(),
                                callbacks=[cb])


def test_saves_every_n_steps_keeps_limit_and_resumes_exactly(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cb = MithrilTrainerCallback(runs, run_id="hf", every_n_steps=2)
    ref = _trainer(tmp_path / "a", cb, steps=6)
    ref.train()
    final = {k: v.clone() for k, v in ref.model.state_dict().items()}
    versions = sorted(p.name for p in (runs / "hf" / "versions").iterdir())
    steps = [json.loads((runs / "hf" / "versions" / v / "manifest.json").read_text())["step"]
             for v in versions]
    assert steps == [4, 6]  # save_total_limit=2: step 2 was retired
    assert not list((tmp_path / "a").glob("checkpoint-*"))  # the Trainer itself wrote nothing

    # a fresh process-alike: new model, resume from step 4 through the Trainer's own logic
    cb2 = MithrilTrainerCallback(runs, run_id="hf", every_n_steps=2)
    t2 = _trainer(tmp_path / "a", cb2, steps=6)
    ckpt = cb2.prepare_resume(t2.args, target=4)
    assert ckpt is not None and Path(ckpt).name == "checkpoint-4"
    assert {p.name for p in Path(ckpt).iterdir()} >= {
        "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
        "rng_state.pth"}
    t2.train(resume_from_checkpoint=ckpt)
    assert t2.state.global_step == 6
    for k, v in t2.model.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_on_save_mode_and_fresh_start(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cb = MithrilTrainerCallback(runs, run_id="hf2")
    t = _trainer(tmp_path / "b", cb, steps=3, save_strategy="steps", save_steps=3)
    assert cb.prepare_resume(t.args) is None  # nothing saved yet: start fresh
    t.train()
    (v,) = (runs / "hf2" / "versions").iterdir()
    assert json.loads((v / "manifest.json").read_text())["step"] == 3
