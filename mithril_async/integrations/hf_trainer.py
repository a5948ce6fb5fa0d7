"""Hugging Face ``transformers.Trainer`` callback: background compressed checkpoints + resume.

    cb = MithrilTrainerCallback("runs", every_n_steps=500)       # or every_n_steps=None:
    trainer = Trainer(..., args=TrainingArguments(save_strategy="no", save_total_limit=3),
                      callbacks=[cb])                              # save when the Trainer saves
    trainer.train(resume_from_checkpoint=cb.prepare_resume(trainer.args))   # None: fresh start

Saving: at every N optimizer steps (``on_step_end``), or whenever the Trainer itself saves
(``on_save``, when ``every_n_steps`` is None), the callback hands model, optimizer, scheduler,
the ``TrainerState`` and the RNG state to a :class:`~mithril_async.CheckpointManager`, which
returns after a snapshot; compression and writing continue in the background while training
goes on. ``save_total_limit`` keeps the newest N versions, and the best version (by
``metric_for_best_model``/``greater_is_better``, from the last evaluation) is never deleted,
as the Trainer does. A failed background save is raised at the next save or at the end of
training, never swallowed.

Resuming: ``prepare_resume`` materialises a committed version as an ordinary Trainer
checkpoint folder (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``trainer_state.json``, ``rng_state.pth``) under ``<output_dir>/mithril-resume/`` and returns
its path for ``resume_from_checkpoint``, so the Trainer's own resume logic (data skipping, RNG,
schedulers) runs unchanged. Why not restore in a callback: the Trainer reads the folder before
any callback runs. Only world process zero saves (replicated data parallel); sharded models
(FSDP/DeepSpeed ZeRO-3) are not supported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from mithril_async.config import Config, config_from_dict
from mithril_async.errors import StepAlreadyExists
from mithril_async.manager import CheckpointManager

__all__ = ["MithrilTrainerCallback"]

log = logging.getLogger("mithril_async")


class _TrainerStateItem:
    """The live ``TrainerState`` as a JSON state (``get_state``) for the manager."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def get_state(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self.state),
                                                    default=str))
        return doc

    def set_state(self, state: dict[str, Any]) -> None:
        """The Trainer restores its state from ``trainer_state.json`` itself."""


class MithrilTrainerCallback(TrainerCallback):
    """Background compressed checkpointing for ``transformers.Trainer`` (see module docs)."""

    def __init__(self, runs_path: str | os.PathLike[str], *, run_id: str | None = None,
                 every_n_steps: int | None = None, compression_level: int = 3,
                 config: dict[str, Any] | None = None) -> None:
        self.runs_path = os.fspath(runs_path)
        self.run_id = run_id
        self.every_n_steps = every_n_steps
        self.compression_level = compression_level
        self.extra_config = dict(config or {})
        self.manager: CheckpointManager | None = None
        self._metrics: dict[str, Any] = {}

    # ---------------------------------------------------------------- config
    def _run_id(self, args: TrainingArguments) -> str:
        return self.run_id or f"hf-{Path(args.output_dir or 'trainer').name}"

    def make_config(self, args: TrainingArguments) -> Config:
        """The manager's config, from the Trainer's arguments (save_total_limit, best metric)."""
        ck: dict[str, Any] = {"runs_path": self.runs_path, "run_id": self._run_id(args),
                              "ckpting_save_iter": self.every_n_steps or 1,
                              "compression": {"level": self.compression_level}}
        if args.save_total_limit:
            ck["keep_last"] = args.save_total_limit
        metric = args.metric_for_best_model
        if metric:
            ck["best_metric_name"] = metric if metric.startswith("eval_") else f"eval_{metric}"
            ck["best_mode"] = "max" if args.greater_is_better else "min"
        ck.update(self.extra_config)
        return config_from_dict({"checkpointing": ck}, where="MithrilTrainerCallback")

    def _manager(self, args: TrainingArguments, state: TrainerState,
                 kwargs: dict[str, Any]) -> CheckpointManager:
        if self.manager is None:
            items: dict[str, Any] = {"model": kwargs["model"],
                                     "trainer_state": _TrainerStateItem(state)}
            if kwargs.get("optimizer") is not None:
                items["optimizer"] = kwargs["optimizer"]
            if kwargs.get("lr_scheduler") is not None:
                items["scheduler"] = kwargs["lr_scheduler"]
            self.manager = CheckpointManager(self.make_config(args), items)
        return self.manager

    def _save(self, args: TrainingArguments, state: TrainerState,
              kwargs: dict[str, Any]) -> None:
        if not state.is_world_process_zero or state.global_step <= 0:
            return
        mgr = self._manager(args, state, kwargs)
        try:
            mgr.save_nowait(state.global_step, metrics=self._metrics)
        except StepAlreadyExists:
            log.warning("step %d is already saved in run %s; not saved again",
                        state.global_step, mgr.run_id)

    # ---------------------------------------------------------------- events
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if metrics:
            self._metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._save(args, state, kwargs)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if not self.every_n_steps:
            self._save(args, state, kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Wait for the last save; a background failure is raised here."""
        if self.manager is not None:
            mgr, self.manager = self.manager, None
            try:
                mgr.wait()
            finally:
                mgr.close()

    # ---------------------------------------------------------------- resume
    def prepare_resume(self, args: TrainingArguments, target: str | int = "latest"
                       ) -> str | None:
        """A Trainer checkpoint folder for ``target`` (None when the run has no version yet)."""
        from mithril_async.catalog import open_catalog
        from mithril_async.errors import VersionNotFound
        from mithril_async.pipeline.reader import VersionReader

        run_id = self._run_id(args)
        if not (Path(self.runs_path) / run_id / "versions").is_dir():
            return None
        try:
            with VersionReader(open_catalog(self.runs_path, run_id)) as reader:
                got = asyncio.run(reader.read_version(target))
        except VersionNotFound:
            if target == "latest":
                return None
            raise
        manifest, trees, rng_doc = got.manifest, got.trees, got.rng
        out = Path(args.output_dir or ".") / "mithril-resume" / f"checkpoint-{manifest.step}"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        write_hf_checkpoint(out, trees, rng_doc)
        return str(out)


def write_hf_checkpoint(out: Path, trees: dict[str, Any], rng_doc: dict[str, Any]) -> None:
    """Write the files ``Trainer._load_from_checkpoint`` and friends read."""
    from mithril_async.integrations.safetensors_file import flatten_tensors, write_safetensors
    from mithril_async.state import decode_rng_state

    write_safetensors(flatten_tensors(trees["model"]), out / "model.safetensors",
                      {"format": "pt"})
    if "optimizer" in trees:
        torch.save(trees["optimizer"], out / "optimizer.pt")
    if "scheduler" in trees:
        torch.save(trees["scheduler"], out / "scheduler.pt")
    state = rng_doc.get("states", {}).get("trainer_state")
    if state is not None:
        (out / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    rng = rng_doc.get("rng")
    if rng:
        py, npst = rng["python"], rng["numpy"]
        hf: dict[str, Any] = {
            "python": (py[0], tuple(py[1]), py[2]),
            "numpy": (npst[0], np.asarray(npst[1], dtype=np.uint32), *npst[2:]),
            "cpu": decode_rng_state(rng["torch"]),
        }
        if rng.get("cuda"):  # the Trainer saves one state, or a list when distributed
            cuda = [decode_rng_state(s) for s in rng["cuda"]]
            hf["cuda"] = cuda[0] if len(cuda) == 1 else cuda
        torch.save(hf, out / "rng_state.pth")
