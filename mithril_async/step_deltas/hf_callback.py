"""Hugging Face ``TrainerCallback`` form of :class:`SparseDeltaRecorder`.

``transformers`` is optional: this module is imported only when ``SparseDeltaCallback`` is
asked for. Timing: the Trainer calls ``on_optimizer_step`` right after ``optimizer.step()``
and before ``zero_grad``/``global_step += 1``, so the delta of that update is recorded as
step ``state.global_step + 1`` - the same number as the Trainer's ``checkpoint-<N>`` holding
those weights. The recorder is created at ``on_train_begin`` (the weights before the first
update are the base) and closed at ``on_train_end``. Only the world process zero records
(replicated data-parallel weights are identical); sharded parameters (FSDP/DeepSpeed ZeRO-3)
are not supported.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from mithril_async.step_deltas.recorder import SparseDeltaRecorder


class SparseDeltaCallback(TrainerCallback):
    """Records a sparse delta after every optimizer step of a ``transformers.Trainer``."""

    def __init__(
        self,
        delta_dir: str | os.PathLike[str],
        dtype: torch.dtype = torch.bfloat16,
        **recorder_kwargs: Any,
    ) -> None:
        self.delta_dir = os.fspath(delta_dir)
        self.dtype = dtype
        self.recorder_kwargs = recorder_kwargs
        self.recorder: SparseDeltaRecorder | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or self.recorder is not None:
            return
        if model is None:
            raise ValueError("SparseDeltaCallback needs the model in on_train_begin")
        kw = {"base_step": state.global_step, **self.recorder_kwargs}
        self.recorder = SparseDeltaRecorder(model, self.delta_dir, self.dtype, **kw)

    def on_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.recorder is not None:
            self.recorder.record(state.global_step + 1)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.recorder is not None:
            rec, self.recorder = self.recorder, None
            rec.close()
