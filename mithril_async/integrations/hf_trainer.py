"""Hugging Face ``transformers.Trainer`` callback: background compressed checkpoints + resume.

    cb = MithrilTrainerCallback("runs", every_n_steps=500)       # or every_n_steps=None:
    trainer = Trainer(..., args=TrainingArguments(..., save_total_limit=3),
                      callbacks=[cb])                              # save when the Trainer would
    trainer.train(resume_from_checkpoint=True)     # the usual idiom: resumes from our latest

Saving: at every N optimizer steps, or (``every_n_steps=None``) whenever the Trainer's
``save_strategy`` asks for a checkpoint, the callback hands model, optimizer, scheduler, the
``TrainerState`` and the RNG state to a :class:`~mithril_async.CheckpointManager`, which
returns after a snapshot; compression and writing continue in the background while training
goes on. The callback owns saving: it clears ``control.should_save``, so the Trainer writes no
full checkpoint of its own beside ours (``keep_hf_checkpoints=True`` keeps them; with
``save_strategy="best"`` the Trainer decides after every callback has run, so its checkpoints
are kept then). ``save_total_limit`` keeps the newest N versions, and the best version (by
``metric_for_best_model``/``greater_is_better``, from the last evaluation) is never deleted,
as the Trainer does. A failed background save is raised at the next save or at the end of
training, never swallowed.

When a step's snapshot is taken: the Trainer calls ``on_step_end`` *before* it logs, evaluates
and saves that step, so a snapshot there would miss the step's ``log_history`` entry. The
callback marks the step due in ``on_step_end`` and takes the snapshot at the next event that
follows the step's logging and evaluation: ``on_step_begin`` of the next step (after its
batch was fetched, which is where the Trainer restores the RNG when it resumes mid-epoch),
``on_epoch_begin`` of the next epoch (before its data order is drawn, where the Trainer
restores it at an epoch boundary) or ``on_train_end``. Model, optimizer and scheduler have not
moved since the step.

Preemption (``config={"save_on_signals": ["SIGTERM"]}``, see
:mod:`~mithril_async.preemption`): the callback makes its manager, and so installs the
handler, at ``on_train_begin``; a signal during ``trainer.train()`` marks the current step due
at its ``on_step_end`` (the snapshot follows as above), and once that save is durable the
signal takes its previous effect (SIGTERM's default: the process ends as SLURM or Kubernetes
meant). With ``exit_after_signal_save = false`` the callback sets
``control.should_training_stop`` instead, and ``train()`` returns after the save. Only world
process zero saves, so only it holds the signal back; other processes keep their own
disposition.

Save results reach the Trainer's loggers: each save that ends (a result listener of the
manager, called off the training thread) is logged at the next ``on_step_end`` or at
``on_train_end``, on the training thread, through ``trainer.log`` (so ``log_history`` and
every ``report_to`` integration see it): ``checkpoint/stall_ms`` (the loop's stall),
``checkpoint/total_s``, ``checkpoint/ratio``, ``checkpoint/bytes`` (bytes written) and
``checkpoint/step``; a failed save as ``checkpoint/failed = 1`` (and at ERROR in the Python
log), a skipped one as ``checkpoint/skipped = 1``. Callbacks are not given their Trainer: the
callback finds the one whose callback handler calls it on the call stack at ``on_init_end``
or ``on_train_begin``; without one (a loop that calls callbacks itself) the entries go to
``state.log_history`` only.

Resuming with ``trainer.train(resume_from_checkpoint=True)``: the Trainer looks for
``<output_dir>/checkpoint-<step>`` before any callback runs, so at ``on_init_end`` (the
Trainer's construction) the callback materialises only what the Trainer itself reads there
from our latest committed version: ``model.safetensors``, ``trainer_state.json`` and
``rng_state.pth`` (logged with its size; ``resume_info`` records it). The optimizer and
scheduler states, the bulk of a checkpoint, are never written out: the Trainer loads them only
when ``optimizer.pt`` exists, and the callback loads them into the live objects in
``on_train_begin``, where it also removes the model file and state; the folder (its RNG file)
goes once the Trainer has read it, at the first step. A later HF checkpoint in ``output_dir``
(a higher step) wins as usual; ``resume_target=None`` turns this off. Only world process zero
saves (replicated data parallel); sharded models (FSDP/DeepSpeed ZeRO-3) are not supported.

Exports: when it creates its manager (the first save of a process) the callback records the
model's ``config.json`` (and ``generation_config.json`` for a model that generates) and the
Trainer's ``processing_class`` (tokenizer or processor) files into the run
(:func:`~mithril_async.export.hf_files.record_hf_files`), so ``mithril export RUN --hf DIR``
writes a folder ``from_pretrained`` loads. A failure there is logged with its traceback and
training goes on (an export then holds the weights only, and says so).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from mithril_async.config import Config, config_from_dict
from mithril_async.errors import StepAlreadyExists
from mithril_async.manager import CheckpointManager
from mithril_async.pipeline.loop import run_to_completion
from mithril_async.save.coordinator import LocalCoordinator
from mithril_async.save.results import SaveResult

__all__ = ["MithrilTrainerCallback", "write_hf_checkpoint"]

log = logging.getLogger("mithril_async")


#: the marker file of a folder this callback materialised (so only such folders are removed)
_MARKER = ".mithril-resume"


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
                 config: dict[str, Any] | None = None, keep_hf_checkpoints: bool = False,
                 resume_target: str | int | None = "latest") -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool)
                                          or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"MithrilTrainerCallback: every_n_steps must be a positive int or "
                             f"None, got {every_n_steps!r}")
        self.runs_path = os.fspath(runs_path)
        self.run_id = run_id
        self.every_n_steps = every_n_steps
        self.compression_level = compression_level
        self.extra_config = dict(config or {})
        self.keep_hf_checkpoints = keep_hf_checkpoints
        self.resume_target = resume_target
        self.manager: CheckpointManager | None = None
        self._metrics: dict[str, Any] = {}
        self._due = False
        #: the folder materialised for the Trainer's resume: path, step, files, bytes
        self.resume_info: dict[str, Any] | None = None
        self._resume_version: str | None = None
        #: the Trainer whose ``log`` reports the saves (found when it calls us: module docs)
        self.trainer: Any = None
        #: results of ended saves, appended by the manager's listener, logged by the loop
        self._ended: deque[SaveResult] = deque()

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
            # only world process zero saves (the weights are the same on every DDP rank):
            # its manager must not start collectives the other processes never join
            self.manager = CheckpointManager(self.make_config(args), items,
                                             on_result=self._ended.append,
                                             coordinator=LocalCoordinator())
            self._record_hf_files(kwargs)
        return self.manager

    def _record_hf_files(self, kwargs: dict[str, Any]) -> None:
        """The model's config and the tokenizer's files into the run, for exports."""
        from mithril_async.export.hf_files import record_hf_files

        assert self.manager is not None
        try:
            names = record_hf_files(self.manager, kwargs["model"],
                                    kwargs.get("processing_class"))
        except Exception:  # checkpoints matter more than the files an export copies
            log.exception("could not record the model's Hugging Face files in run %s (an "
                          "export of it will hold the weights only)", self.manager.run_id)
            return
        log.info("recorded %s in run %s for exports", ", ".join(names) or "no files",
                 self.manager.run_id)

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

    def _flush(self, args: TrainingArguments, state: TrainerState,
               kwargs: dict[str, Any]) -> None:
        """Take the snapshot of a due step (its logs and evaluation are in the state now)."""
        if self._due:
            self._due = False
            self._save(args, state, kwargs)

    def _take_over(self, control: TrainerControl, due: bool) -> None:
        if due:
            self._due = True
        if control.should_save and not self.keep_hf_checkpoints:
            control.should_save = False  # ours replaces the Trainer's full checkpoint

    # ---------------------------------------------------------------- events
    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self.trainer = self.trainer or _calling_trainer(self)
        if self.resume_target is None or not state.is_world_process_zero:
            return
        try:
            self._materialize(args, self.resume_target)
        except Exception:  # building a Trainer must not fail on a run it may not resume
            log.exception("could not prepare %s of run %s for the Trainer's resume (a "
                          "resume_from_checkpoint=True will find no checkpoint of ours)",
                          self.resume_target, self._run_id(args))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self.trainer = self.trainer or _calling_trainer(self)
        if state.is_world_process_zero and self.make_config(args).checkpointing.save_on_signals:
            self._manager(args, state, kwargs)  # the signal handler, before the first step
        info = self.resume_info
        if info is None:
            return
        resumed = state.global_step == info["step"] and state.global_step > 0
        if resumed:  # the Trainer loaded model and state from our folder: now the rest
            self._load_optimizer_and_scheduler(args, kwargs)
        folder = Path(info["path"])
        for name in ("model.safetensors", "trainer_state.json"):
            (folder / name).unlink(missing_ok=True)
        if not resumed:
            self._remove_resume_folder()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if metrics:
            self._metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._remove_resume_folder()  # the Trainer has read its RNG file by now
        self._flush(args, state, kwargs)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._flush(args, state, kwargs)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.every_n_steps:
            due = state.global_step % self.every_n_steps == 0
        else:
            due = control.should_save  # the Trainer's save_strategy decided (steps, end)
        self._report_saves(state, control)
        self._take_over(control, self._signal_due(state, control) or due)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._take_over(control, not self.every_n_steps and control.should_save)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """The Trainer saved anyway (``keep_hf_checkpoints``, ``save_strategy="best"``)."""
        if not self.every_n_steps and not self.keep_hf_checkpoints:
            self._due = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Take a due snapshot, then wait for the last save; a background failure is raised
        here."""
        self._remove_resume_folder()
        try:
            self._flush(args, state, kwargs)
        finally:
            if self.manager is not None:
                mgr, self.manager = self.manager, None
                try:
                    mgr.wait()
                finally:
                    mgr.close()
                    self._report_saves(state)

    # ---------------------------------------------------------------- signals, loggers
    def _signal_due(self, state: TrainerState, control: TrainerControl) -> bool:
        """Whether a signal asks for a save of this step; stop once its save ended
        (``exit_after_signal_save = false``)."""
        mgr = self.manager
        if mgr is None or mgr.preemption is None:
            return False
        if mgr.preempted:
            control.should_training_stop = True
        return mgr.preemption.due(state.global_step)

    def _report_saves(self, state: TrainerState, control: TrainerControl | None = None) -> None:
        """Log the saves that ended since the last call through the Trainer (training
        thread). ``Trainer.log`` clears ``control.should_log`` (it thinks it just logged the
        step): it is put back, or the step's own loss entry would never be logged."""
        should_log = control.should_log if control is not None else False
        while self._ended:
            logs = save_metrics(self._ended.popleft())
            if self.trainer is not None:
                self.trainer.log(logs)
            else:
                state.log_history.append({**logs, "step": state.global_step})
        if control is not None:
            control.should_log = should_log

    # ---------------------------------------------------------------- resume
    def _materialize(self, args: TrainingArguments, target: str | int) -> None:
        """Write the files the Trainer reads before any callback runs (module docs)."""
        from mithril_async.catalog import open_catalog
        from mithril_async.errors import VersionNotFound
        from mithril_async.integrations.safetensors_file import flatten_tensors, write_safetensors
        from mithril_async.restore.reader import VersionReader

        run_id = self._run_id(args)
        if not (Path(self.runs_path) / run_id / "versions").is_dir():
            return
        try:
            with VersionReader(open_catalog(self.runs_path, run_id)) as reader:
                got = run_to_completion(reader.read_version(target, items=["model"]))
        except VersionNotFound:
            if target == "latest":
                return
            raise
        step = got.manifest.step
        output = Path(args.output_dir or ".")
        if _newest_hf_step(output) >= step:
            log.info("output_dir %s holds a Trainer checkpoint at or after step %d: the "
                     "Trainer resumes from that one", output, step)
            return
        for stale in output.glob("checkpoint-*"):  # what a killed process left: ours only
            if (stale / _MARKER).is_file():
                shutil.rmtree(stale, ignore_errors=True)
        out = output / f"checkpoint-{step}"
        out.mkdir(parents=True)
        (out / _MARKER).write_text(got.manifest.version_id)
        write_safetensors(flatten_tensors(got.trees["model"]), out / "model.safetensors",
                          {"format": "pt"})
        write_hf_checkpoint(out, {}, got.rng)
        files = {p.name: p.stat().st_size for p in out.iterdir() if p.name != _MARKER}
        self.resume_info = {"path": str(out), "step": step, "files": files,
                            "bytes": sum(files.values()), "version": got.manifest.version_id}
        self._resume_version = got.manifest.version_id
        log.info("materialised %s for the Trainer's resume from %s/%s: %d bytes (%s); "
                 "optimizer and scheduler are loaded in on_train_begin, the folder is removed "
                 "after the Trainer read it", out, run_id, got.manifest.version_id,
                 self.resume_info["bytes"], ", ".join(sorted(files)))

    def _load_optimizer_and_scheduler(self, args: TrainingArguments,
                                      kwargs: dict[str, Any]) -> None:
        from mithril_async.catalog import open_catalog
        from mithril_async.restore.reader import VersionReader

        assert self._resume_version is not None
        want = [n for n, key in (("optimizer", "optimizer"), ("scheduler", "lr_scheduler"))
                if kwargs.get(key) is not None]
        if not want:
            return
        with VersionReader(open_catalog(self.runs_path, self._run_id(args))) as reader:
            got = run_to_completion(reader.read_version(self._resume_version, items=want,
                                                        rng=False))
        if "optimizer" in want and "optimizer" in got.trees:
            kwargs["optimizer"].load_state_dict(got.trees["optimizer"])
        if "scheduler" in want and "scheduler" in got.trees:
            kwargs["lr_scheduler"].load_state_dict(got.trees["scheduler"])

    def _remove_resume_folder(self) -> None:
        info = self.resume_info
        if info is None or info.get("removed"):
            return
        folder = Path(info["path"])
        if (folder / _MARKER).is_file():  # never a folder the Trainer itself wrote
            shutil.rmtree(folder, ignore_errors=True)
        info["removed"] = True

    def prepare_resume(self, args: TrainingArguments, target: str | int = "latest"
                       ) -> str | None:
        """The folder for ``trainer.train(resume_from_checkpoint=...)`` from ``target`` (None
        when the run has no version yet): the same light folder as the automatic resume, for
        a target other than the latest (construct the callback with ``resume_target=None``)."""
        self._remove_resume_folder()
        self.resume_info = self._resume_version = None
        self._materialize(args, target)
        return None if self.resume_info is None else str(self.resume_info["path"])


def save_metrics(res: SaveResult) -> dict[str, float]:
    """The entries a save's result adds to the Trainer's logs."""
    out = {"checkpoint/step": float(res.step)}
    if res.status == "committed":
        out.update({"checkpoint/stall_ms": (res.stall_s + res.step_wait_s) * 1e3,
                    "checkpoint/total_s": res.total_s, "checkpoint/ratio": res.ratio,
                    "checkpoint/bytes": float(res.bytes_out)})
    else:
        out[f"checkpoint/{res.status}"] = 1.0
    return out


def _calling_trainer(cb: TrainerCallback) -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling ``cb`` now, found on
    the call stack (None when no Trainer is calling)."""
    from transformers import Trainer

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and cb in getattr(owner.callback_handler, "callbacks", ()):
            return owner
        frame = frame.f_back
    return None


_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def _newest_hf_step(output: Path) -> int:
    """The highest step of a ``checkpoint-N`` folder the Trainer itself wrote (-1: none)."""
    try:
        names = os.listdir(output)
    except OSError:
        return -1
    steps = [int(m.group(1)) for n in names if (m := _CHECKPOINT_DIR.match(n))
             and (output / n).is_dir() and not (output / n / _MARKER).exists()]
    return max(steps, default=-1)


def write_hf_checkpoint(out: Path, trees: dict[str, Any], rng_doc: dict[str, Any]) -> None:
    """Write the files ``Trainer._load_from_checkpoint`` and friends read, of the items in
    ``trees`` (model, optimizer, scheduler) and the RNG/state document: a full Trainer
    checkpoint folder, e.g. for tools that read one (the resume itself writes less)."""
    from mithril_async.integrations.safetensors_file import flatten_tensors, write_safetensors
    from mithril_async.state import decode_rng_state

    if "model" in trees:
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
