"""SparseDeltaCallback inside a real transformers.Trainer run (tiny model built here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from mithril_async.step_deltas import (  # noqa: E402
    SparseDeltaCallback,
    read_metadata,
    reconstruct_weights_at_step,
)
from tests.step_deltas._training import bits_equal  # noqa: E402


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 32, (16, 8), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def test_trainer_callback_records_every_optimizer_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32,
        n_positions=8,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_inner=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: never in a delta
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    cb = SparseDeltaCallback(tmp_path / "deltas", dtype=torch.bfloat16)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb])
    trainer.train()
    assert cb.recorder is None  # closed at on_train_end

    meta = read_metadata(tmp_path / "deltas")
    assert [e["step"] for e in meta["checkpoints"]] == [1, 2, 3, 4]  # optimizer steps
    assert meta["base_step"] == 0
    got = reconstruct_weights_at_step(base, tmp_path / "deltas", 4)
    for name, p in model.named_parameters():
        assert bits_equal(got[name], p.detach().to(torch.bfloat16)), name
    assert bits_equal(got["transformer.wpe.weight"], base["transformer.wpe.weight"].bfloat16())
