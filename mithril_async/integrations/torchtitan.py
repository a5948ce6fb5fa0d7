"""torchtitan checkpoint backend: a ``BaseCheckpointManager`` that saves through mithril_async.

A torchtitan job switches backends by configuration alone; its ``checkpoint`` field takes
any ``BaseCheckpointManager.Config``::

    from mithril_async.integrations.torchtitan import MithrilCheckpointManager

    config.checkpoint = MithrilCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, keep_latest_k=3,
        mithril="mithril.toml",            # or a table: {"checkpointing": {...}}; None: defaults
    )

The trainer builds it with ``config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states=..., sd_adapter=..., base_folder=...)`` and drives it
as any torchtitan manager: ``load(step)`` before training, ``save(step, last_step)`` after
every step, ``maybe_wait_for_staging()`` before each optimizer step, ``close()`` at the end.
Each save goes to a :class:`~mithril_async.CheckpointManager` (worker process, compression,
versions, aliases, retention, S3, tiers: everything the mithril configuration asks for) as one
version of the run ``<dump_folder>/<folder>/<run_id>`` (``run_id`` from the mithril
configuration, default ``"torchtitan"``, so a restarted job finds its run).

What is saved: the trainer's ``states`` (``train_state``: step and tokens seen), the model
(torchtitan's ``ModelWrapper``: the flattened state dicts of every model part), the
optimizers and LR schedulers (their containers' flattened state dicts), the data loader's
position (per rank) and the RNG state of every rank, so a resumed run continues bit-identically.

torchtitan's fields, each honoured or refused by name (:class:`~mithril_async.ConfigError`):

* ``enable``, ``load_only`` (loads, never saves), ``interval`` (also the manager's
  ``ckpting_save_iter``, so ``save_on_signals`` works), ``enable_first_step_checkpoint``;
* ``keep_latest_k``: retention keeps the newest k versions (0: all), combined with the
  mithril table's ``keep_best`` / ``keep_every_n_steps`` (a version is kept if any keeps it);
* ``load_step`` (the trainer passes it to ``load``): that step, or the latest when -1;
* ``exclude_from_loading``: those states keep their live values at ``load`` (``optimizer``
  through the manager's ``resume_optimizer = false``);
* ``async_mode``: ``"async"`` (the default here) and ``"async_with_pinned_mem"`` return once
  the snapshot is taken (``save_future`` follows the background part), ``"disabled"`` waits
  until the version is committed;
* ``last_save_model_only`` with ``export_dtype``: the last step's save holds only the model,
  cast to ``export_dtype``, as a version of the run ``<run_id>-model`` beside the training run
  (``mithril export`` reads it; resuming reads the training run, never this one); with
  ``last_save_model_only=False`` the last step is a full version of the training run;
* ``initial_load_path`` (when the run has no version yet): a mithril run folder
  (``<runs>/<run_id>``) or a torchtitan DCP checkpoint (a folder with ``.metadata``), so a job
  moves from DCP to this backend by pointing at its last ``step-N`` folder;
  ``initial_load_model_only`` says whether only the model is loaded from it;
* refused: ``last_save_in_hf``, ``initial_load_in_hf``, ``initial_load_in_hf_quantized``,
  ``create_seed_checkpoint``, a remote ``folder`` (use ``[checkpointing.remote]`` or
  ``tiers``), and in the mithril table ``runs_path``, ``ckpting_save_iter`` and ``keep_last``
  (torchtitan's ``folder``, ``interval`` and ``keep_latest_k`` set them).

Sharded models (FSDP2 ``fully_shard``, tensor parallel: DTensor parameters) are saved as each
rank's shards (:class:`~mithril_async.sharded.ShardedModel` /
:class:`~mithril_async.sharded.ShardedOptimizer`) and restored onto any world size and
mesh; torchtitan's data loader cannot change its degree (exclude it from loading to resume on
another world size). ``last_save_model_only`` is refused for a sharded model (its export
would gather the model on one rank), and so are several model parts with DTensor parameters
(pipeline parallel).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from mithril_async.config import Config as MithrilConfig
from mithril_async.config import config_from_dict, load_config
from mithril_async.errors import ConfigError, VersionNotFound
from mithril_async.manager import CheckpointManager

__all__ = ["DEFAULT_RUN_ID", "MithrilCheckpointManager"]

log = logging.getLogger("mithril_async")

#: the run a torchtitan job saves into when the mithril configuration names none: fixed, so
#: a restarted job resumes from the run its previous attempt wrote
DEFAULT_RUN_ID = "torchtitan"
#: [checkpointing] keys torchtitan's own fields set (the key, the field that sets it)
_OWNED = {"runs_path": "checkpoint.folder", "ckpting_save_iter": "checkpoint.interval",
          "keep_last": "checkpoint.keep_latest_k"}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _refuse(field: str, why: str) -> ConfigError:
    return ConfigError(f"checkpoint.{field}: {why} (MithrilCheckpointManager)")


# ---------------------------------------------------------------- state adapters
class _KeepLive:
    """A state excluded from loading: saved as usual, its live value kept at ``load``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = self.obj.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Excluded by ``exclude_from_loading``: nothing is loaded."""


def _to_json(x: Any) -> Any:
    if isinstance(x, bytes):
        return {"__bytes__": base64.b64encode(x).decode("ascii")}
    if isinstance(x, dict):
        return {str(k): _to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_json(v) for v in x]
    return x


def _from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__bytes__"}:
            return base64.b64decode(x["__bytes__"])
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


class _JsonState:
    """A torchtitan state as a per-rank JSON state (``get_state``/``set_state``), saved by
    every rank where a ``state_dict`` item would be rank 0's alone; ``exclude``: saved, not
    loaded. Two kinds take this form:

    * a data loader: torchtitan's keep one position per data-parallel rank (``{"dp_rank_<r>":
      pickled StatefulDataLoader state, "world_size": n}``). The pickled bytes travel
      base64-encoded and are given back to the loader as they were: loading them is the
      loader's own business, as with torchtitan's DCP checkpoints;
    * a state every rank holds alike (the LR schedulers, the trainer's step) with a sharded
      model: a restore onto another world size gives each rank the saved state of the rank of
      its number, or rank 0's (a ``state_dict`` item of every rank would have no shard
      metadata to remap)."""

    def __init__(self, obj: Any, exclude: bool) -> None:
        self.obj, self.exclude = obj, exclude

    def get_state(self) -> dict[str, Any]:
        return {"torchtitan": _to_json(self.obj.state_dict())}

    def set_state(self, state: dict[str, Any]) -> None:
        if not self.exclude and isinstance(state, dict) and "torchtitan" in state:
            self.obj.load_state_dict(_from_json(state["torchtitan"]))


class _ExportModel:
    """The model alone, floating tensors cast to ``export_dtype`` (the last model-only save)."""

    def __init__(self, model: ModelWrapper, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def state_dict(self) -> dict[str, Any]:
        return {k: v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ConfigError("the model-only export run is not loaded into a trainer; resume "
                          "from the training run")


# ---------------------------------------------------------------- configuration
def mithril_config(source: str | os.PathLike[str] | Mapping[str, Any] | None, *, folder: str,
                   interval: int, keep_latest_k: int, resume_optimizer: bool | None
                   ) -> MithrilConfig:
    """The mithril configuration of a torchtitan job: ``source`` (a TOML path, a table, or
    None for the defaults) with the ``[checkpointing]`` keys torchtitan's fields own set
    from them. Setting one of those keys in ``source`` too is a :class:`ConfigError`."""
    if source is None:
        cfg = config_from_dict({}, where="checkpoint.mithril")
    elif isinstance(source, (str, os.PathLike)):
        cfg = load_config(Path(source))
    elif isinstance(source, Mapping):
        cfg = config_from_dict(dict(source), where="checkpoint.mithril")
    else:
        raise _refuse("mithril", f"a TOML path, a table or None, not a {type(source).__name__}")
    ck = cfg.checkpointing
    for key, owner in _OWNED.items():
        if key in ck.model_fields_set:
            raise _refuse("mithril", f"[checkpointing] {key} is set by torchtitan's {owner}; "
                                     "remove it from the mithril configuration")
    table = ck.model_dump(mode="python", exclude_unset=True)
    table.update(runs_path=folder, ckpting_save_iter=interval,
                 keep_last=keep_latest_k or None, run_id=ck.run_id or DEFAULT_RUN_ID)
    if resume_optimizer is not None:
        table["resume_optimizer"] = resume_optimizer
    return config_from_dict({**cfg.extra, "checkpointing": table},
                            where="checkpoint.mithril", source=cfg.source_toml)


def _is_remote(path: str) -> bool:
    return "://" in path


# ---------------------------------------------------------------- the manager
def _faces(config: Any, model_parts: list[torch.nn.Module], model: Any, optimizers: Any
           ) -> tuple[bool, Any, Any]:
    """(sharded, the model's face, the optimizer's face) for the manager: torchtitan's own
    wrappers for a model of plain tensors; for DTensor parameters (FSDP2, TP) each rank's
    shards through ``get_model_state_dict`` / ``get_optimizer_state_dict``."""
    sharded = any(isinstance(p, DTensor) for part in model_parts for p in part.parameters())
    if not sharded:
        return False, model, optimizers
    from mithril_async.sharded import ShardedModel, ShardedOptimizer

    if len(model_parts) != 1:
        raise ConfigError(f"MithrilCheckpointManager: {len(model_parts)} model parts with "
                          "DTensor parameters (pipeline parallel) are not supported; one "
                          "sharded model part is")
    if config.last_save_model_only:
        raise _refuse("last_save_model_only", "its export would gather the sharded model on "
                                              "one rank; set it to false")
    inner = list(getattr(optimizers, "optimizers", [optimizers]))
    if len(inner) != 1:
        raise ConfigError(f"MithrilCheckpointManager: {len(inner)} optimizers over one "
                          "sharded model part; one is supported")
    part = model_parts[0]
    return True, ShardedModel(part), ShardedOptimizer(part, inner[0])


class MithrilCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint contract over a mithril_async :class:`CheckpointManager`
    (see the module docs for what each field does)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        mithril: str | dict[str, Any] | None = None
        """The mithril_async configuration: a TOML file's path, a table (``{"checkpointing":
        {...}}``) or None for the defaults."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """"async"/"async_with_pinned_mem": a save returns after its snapshot and writes in
        the background; "disabled": a save returns once its version is committed."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise _refuse("async_mode", f"one of 'disabled', 'async', "
                                            f"'async_with_pinned_mem', not {self.async_mode!r}")
            for name in ("last_save_in_hf", "initial_load_in_hf",
                         "initial_load_in_hf_quantized", "create_seed_checkpoint"):
                if getattr(self, name):
                    raise _refuse(name, "not supported by this backend (its checkpoints are "
                                        "mithril runs; `mithril export --hf` writes "
                                        "safetensors from one)")
            if _is_remote(self.folder):
                raise _refuse("folder", f"{self.folder!r} is remote; keep a local folder and "
                                        "set [checkpointing.remote] or tiers in the mithril "
                                        "configuration")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: concurrent.futures.Future[Any] | None = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        self.sd_adapter = sd_adapter
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        #: the model's and optimizer's faces for the manager (their shards, when sharded)
        self.sharded, self._model_state, self._optim_state = _faces(
            config, model_parts, self.states[MODEL], optimizers)
        exclude = set(config.exclude_from_loading)
        missing = sorted(exclude - set(self.states))
        if missing:
            raise _refuse("exclude_from_loading", f"{missing} are not states of this trainer "
                                                  f"(it has {sorted(self.states)})")
        self.mithril = mithril_config(
            config.mithril, folder=self.folder, interval=config.interval,
            keep_latest_k=config.keep_latest_k,
            resume_optimizer=False if OPTIMIZER in exclude else None)
        state: dict[str, Any] = {}
        for name, obj in self.states.items():
            if obj is None:
                continue
            face = {MODEL: self._model_state, OPTIMIZER: self._optim_state}.get(name, obj)
            if name == DATALOADER or (self.sharded and name != MODEL and name != OPTIMIZER):
                state[name] = _JsonState(obj, name in exclude)
            elif name in exclude and name != OPTIMIZER:
                state[name] = _KeepLive(face)
            else:
                state[name] = face
        self.manager = CheckpointManager(self.mithril, state, sharded_model=self.sharded)
        log.info("torchtitan checkpoints: run %s in %s (process=%s)", self.manager.run_id,
                 self.folder, self.manager.process)

    # ------------------------------------------------------------ save
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        # asked at every step on every rank: a save_on_signals signal is due at the step
        # the ranks agree on
        due = self.manager.should_save(curr_step)
        if self.config.load_only:
            return False
        first = curr_step == 1 and self.config.enable_first_step_checkpoint
        return due or first or last_step

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and self.config.last_save_model_only:
            self._save_model_only(curr_step)
            return True
        handle = self.manager.save_nowait(curr_step)
        if self.config.async_mode == "disabled":
            self.manager.wait()
        else:
            self.save_future = handle.future
        return True

    def _save_model_only(self, step: int) -> None:
        """The last step's model, in ``export_dtype``, as a version of ``<run_id>-model``."""
        self.manager.wait()  # the training run's last save first
        ck = self.mithril.checkpointing
        table = ck.model_dump(mode="python", exclude_unset=True)
        table.update(run_id=f"{self.manager.run_id}-model", save_on_signals=[], keep_last=None)
        cfg = config_from_dict({**self.mithril.extra, "checkpointing": table},
                               where="checkpoint.mithril")
        export = _ExportModel(self.states[MODEL], _DTYPES[self.config.export_dtype])
        with CheckpointManager(cfg, {MODEL: export}) as mgr:
            mgr.save_nowait(step)
        log.info("torchtitan: model-only checkpoint of step %d (%s) in run %s", step,
                 self.config.export_dtype, table["run_id"])

    def _wait_for_saving(self) -> None:
        try:
            self.manager.wait()
        finally:
            self.save_future = None

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ``save`` returns once the snapshot is consistent (with
        ``snapshot = "overlapped"``, the optimizer step itself waits for the copy)."""

    def _close(self) -> None:
        self.save_future = None
        self.manager.close()

    # ------------------------------------------------------------ load
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            if step not in self.manager.all_steps():
                raise VersionNotFound(f"checkpoint.load_step={step}: run "
                                      f"{self.manager.run_id} in {self.folder} has no "
                                      f"committed step {step} (it has "
                                      f"{self.manager.all_steps()})")
            self.manager.restore_sync(step)
            return True
        if self.manager.latest_step() is not None:
            restored = self.manager.restore_sync("latest")
            log.info("torchtitan: resumed from step %d", int(restored))
            return True
        if self.config.initial_load_path:
            self._initial_load(self.config.initial_load_path)
            return True
        log.info("torchtitan: no checkpoint in %s; a fresh start", self.folder)
        return False

    def _initial_load(self, path: str) -> None:
        """Load ``initial_load_path``: a torchtitan DCP checkpoint or a mithril run folder."""
        model_only = self.config.initial_load_model_only
        p = Path(path)
        if (p / ".metadata").is_file():
            self._load_dcp(path, model_only)
            return
        if not p.is_dir():
            raise _refuse("initial_load_path", f"{path!r} is neither a DCP checkpoint folder "
                                               "nor a mithril run folder")
        ck = self.mithril.checkpointing.model_dump(mode="python", exclude_unset=True)
        ck.update(runs_path=str(p.parent), run_id=p.name, save_on_signals=[], tiers=None,
                  remote=None, keep_last=None)
        cfg = config_from_dict({"checkpointing": ck}, where="checkpoint.initial_load_path")
        state = {MODEL: self._model_state} if model_only else self.manager.state
        src = CheckpointManager(cfg, state, sharded_model=self.sharded)
        try:
            if src.latest_step() is None:
                raise _refuse("initial_load_path", f"{path!r} holds no committed version")
            src.restore_sync("latest", load="model" if model_only else "all")
        finally:
            src.close(wait=False)

    def _load_dcp(self, path: str, model_only: bool) -> None:
        """A torchtitan DCP checkpoint into the live states, as torchtitan's own manager
        reads it (the model flattened into the top level)."""
        import torch.distributed.checkpoint as dcp

        model = self.states[MODEL]
        if model_only:
            sd = model.state_dict()
            dcp.load(sd, checkpoint_id=path)
            model.load_state_dict(sd)
            return
        exclude = set(self.config.exclude_from_loading)
        sd = {k: v for k, v in self.states.items()
              if k != MODEL and k not in exclude and v is not None}
        sd.update(model.state_dict())
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
