"""A tiny GPT-2 trained by ``transformers.Trainer`` with :class:`MithrilTrainerCallback`, for
the tests of what the callback reports and how it meets a preemption signal.

    python -m tests.integrations._hf_tiny OUT RUNS   # preempted: SIGTERM at step SIGNAL_AT

The preempted run saves only for the signal (``every_n_steps`` beyond ``max_steps``); a
callback placed before ours sends the process a real SIGTERM at the end of step
``SIGNAL_AT`` and writes ``OUT/step-N`` at the end of every step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from mithril_async.integrations.hf_trainer import MithrilTrainerCallback

SIGNAL_AT = 3


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def trainer(out: Path, callbacks: list[Any], steps: int) -> Any:
    """A Trainer of a one-layer GPT-2 over ``Data`` (no logging of its own, no reports)."""
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                  n_head=2)
    torch.manual_seed(1)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8,
        learning_rate=1e-2, save_strategy="no", logging_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, seed=7, disable_tqdm=True)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args,
                                train_dataset=Data(), callbacks=callbacks)


#: how long the step after the signal's waits for its effect before training goes on (a
#: bound on a hang, never reached when the save ends)
HOLD_S = 120.0


class Signaller(transformers.TrainerCallback):
    """Sends this process ``signum`` at the end of step SIGNAL_AT; marks each step's end.

    At the end of the next step it holds the training thread until ``released()`` (default:
    never, so only the signal taking effect ends the hold) or HOLD_S: training cannot run
    to its end while the signal's save is in flight, however fast the steps are and however
    long the save takes (the first save of a worker starts the worker)."""

    def __init__(self, out: Path, signum: int = signal.SIGTERM,
                 released: Callable[[], bool] = lambda: False) -> None:
        self.out, self.signum, self.released = out, signum, released

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        (self.out / f"step-{state.global_step}").write_text("")
        if state.global_step == SIGNAL_AT:
            os.kill(os.getpid(), self.signum)
        elif state.global_step == SIGNAL_AT + 1:
            end = time.monotonic() + HOLD_S
            while not self.released() and time.monotonic() < end:
                time.sleep(0.01)


def main() -> None:
    out, runs = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    cb = MithrilTrainerCallback(runs, run_id="preempt", every_n_steps=1000,
                                config={"save_on_signals": ["SIGTERM"]})
    trainer(out, [Signaller(out), cb], steps=200).train()
    raise SystemExit(3)  # the signal should have ended the process before this


if __name__ == "__main__":
    main()
