"""The torchtitan backend (mithril_async/integrations/torchtitan.py), driven as torchtitan's
``Trainer`` drives a checkpoint manager, with torchtitan's own ``ModelWrapper``,
``OptimizersContainer``, LR schedulers and ``ParallelAwareDataloader`` on the CPU (the trainer
itself needs a GPU): a run SIGKILLed with a save in flight resumes bit-identically in a new
process; two gloo data-parallel ranks stopped and started again resume each rank's loader
position and RNG; each torchtitan field is honoured or refused by name.

torchtitan (0.3.0) is in the dev extra; where it is not importable these tests skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer.base",
                    reason="torchtitan is not installed (pip install torchtitan==0.3.0)")

from mithril_async import CheckpointManager, ConfigError, VersionNotFound
from mithril_async.config import config_from_dict
from mithril_async.integrations.torchtitan import MithrilCheckpointManager
from tests.integrations import _torchtitan_train as script

SCRIPT = Path(script.__file__)
HERE = SCRIPT.parent
Cfg = MithrilCheckpointManager.Config


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(p: subprocess.Popen[bytes], log: Path) -> None:
    assert p.wait(timeout=300) == 0, log.read_text()[-4000:]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_sigkilled_run_resumes_bitwise_in_a_new_process(tmp_path: Path) -> None:
    """Killed (SIGKILL) right after step 6's save returned (the save handed to the checkpoint
    worker, possibly still being written): a new process loads the latest committed version
    and ends at step 9 with the model, optimizer, scheduler, loader position and RNG of a run
    never interrupted, bit for bit; the killed trainer's checkpoint worker is gone too."""
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    full.mkdir()
    crashed.mkdir()
    ref = _start([str(full), "run", "9"], tmp_path / "full.log")
    killed = _start([str(crashed), "crash", "9", "6"], tmp_path / "crash.log")
    ready = crashed / "ready"
    deadline = time.monotonic() + 300
    while not ready.exists():  # the child says when step 6's save has returned
        if killed.poll() is not None or time.monotonic() > deadline:
            killed.kill()
            pytest.fail("the run to kill ended or hung:\n"
                        + (tmp_path / "crash.log").read_text()[-4000:])
        time.sleep(0.05)
    worker = int(ready.read_text())
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    deadline = time.monotonic() + 60
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the killed trainer's checkpoint worker outlived it"
    _finish(ref, tmp_path / "full.log")

    with CheckpointManager(config_from_dict({"checkpointing": {
            "runs_path": str(crashed / "checkpoint"), "run_id": "torchtitan"}}),
            {"model": torch.nn.Linear(1, 1)}) as reader:
        resumed_from = reader.latest_step()
    assert resumed_from in (4, 6)  # step 6 commits if its worker finished it before dying
    resume = _start([str(crashed), "run", "9"], tmp_path / "resume.log")
    _finish(resume, tmp_path / "resume.log")
    want = torch.load(full / "final.pt", weights_only=False)
    got = torch.load(crashed / "final.pt", weights_only=False)
    assert (want.pop("started_at"), got.pop("started_at")) == (0, resumed_from)
    assert got["state"] == {"step": 9, "ntokens_seen": 72}
    _same(want, got)


def _launch(out: Path, args: list[str], world: int, log: Path, script: Path = SCRIPT) -> None:
    """``world`` gloo ranks of ``script``, launched as torchrun would; all must succeed."""
    from tests.ranks import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(script), str(out), *args],
                              stdout=(log.parent / f"{log.name}.{r}").open("wb"),
                              stderr=subprocess.STDOUT, env={**env, "RANK": str(r)})
             for r in range(world)]
    try:
        for r, p in enumerate(procs):
            assert p.wait(timeout=300) == 0, (log.parent / f"{log.name}.{r}").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_two_gloo_ranks_resume_each_ranks_position_bitwise(tmp_path: Path) -> None:
    """Two data-parallel ranks (gloo, each its own data): a job stopped after step 4 and
    started again resumes every rank (its loader position and RNG too) bit-identical to a
    job never stopped."""
    full, split = tmp_path / "full", tmp_path / "split"
    full.mkdir()
    split.mkdir()
    _launch(full, ["run", "6"], 2, tmp_path / "full.log")
    _launch(split, ["stop", "6", "4"], 2, tmp_path / "first.log")
    _launch(split, ["run", "6"], 2, tmp_path / "second.log")
    for r in range(2):
        want = torch.load(full / f"final-rank{r}.pt", weights_only=False)
        got = torch.load(split / f"final-rank{r}.pt", weights_only=False)
        assert (want.pop("started_at"), got.pop("started_at")) == (0, 4)
        assert got["loader"] == {f"dp_rank_{r}": got["loader"][f"dp_rank_{r}"],
                                 "world_size": 2}
        _same(want, got)
    a, b = (torch.load(full / f"final-rank{r}.pt", weights_only=False) for r in range(2))
    assert a["loader"] != b["loader"]  # the ranks' positions are their own


@pytest.mark.slow
def test_an_fsdp2_model_saved_by_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``, DTensor parameters) on two gloo ranks saves each rank's
    shards; one rank resumes from them: the whole model and AdamW state it holds are the
    two-rank job's at that step, bit for bit, and it trains on and saves at its own size."""
    fsdp = HERE / "_torchtitan_fsdp.py"
    _launch(tmp_path, ["save", "4"], 2, tmp_path / "save.log", script=fsdp)
    _launch(tmp_path, ["resume"], 1, tmp_path / "resume.log", script=fsdp)
    saved = torch.load(tmp_path / "save.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=False)
    assert saved["step"] == resumed["step"] == 4
    _same(saved["model"], resumed["model"])
    _same(saved["optimizer"], resumed["optimizer"])
    _same(saved["scheduler"], resumed["scheduler"])
    mans = [json.loads(p.read_text()) for p in
            sorted((tmp_path / "checkpoint/fsdp/versions").glob("*/manifest.json"))]
    assert [(m["step"], m["world_size"]) for m in mans] == [(2, 2), (4, 2), (6, 1)]


# ---------------------------------------------------------------- in process
def _build(tmp_path: Path, steps: int = 6, **fields: Any) -> dict[str, Any]:
    fields.setdefault("interval", 1)
    fields.setdefault("keep_latest_k", 0)
    fields.setdefault("last_save_model_only", False)
    return script.build(str(tmp_path), Cfg(enable=True, **fields), steps)


def _train(parts: dict[str, Any], steps: int) -> None:
    """The Trainer's loop (the script's, without the final dump)."""
    model, opt, sched, state = (parts["model"], parts["optimizers"], parts["schedulers"],
                                parts["state"])
    data = script.batches(parts["loader"])
    while state.step < steps:
        state.step += 1
        x, y = next(data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        parts["checkpointer"].maybe_wait_for_staging()
        opt.step()
        sched.step()
        opt.zero_grad()
        parts["checkpointer"].save(state.step, last_step=state.step == steps)


def test_interval_keep_latest_k_and_load_step(tmp_path: Path) -> None:
    """Saves every ``interval`` steps and at the last; ``keep_latest_k`` versions survive;
    ``load(step)`` restores that step, a step not committed is refused by name."""
    parts = _build(tmp_path, interval=2, keep_latest_k=2, async_mode="disabled")
    ckpt = parts["checkpointer"]
    try:
        assert ckpt.load() is False  # a fresh start
        _train(parts, 7)
        assert ckpt.save_future is None  # async_mode="disabled": committed when save returned
        assert ckpt.manager.all_steps() == [6, 7]
        with pytest.raises(VersionNotFound, match="load_step=4"):
            ckpt.load(step=4)
        assert ckpt.load(step=6) is True
        assert parts["state"].step == 6
    finally:
        ckpt.close()


def test_async_save_future_and_wait(tmp_path: Path) -> None:
    """``async_mode="async"``: ``save_future`` follows the background part, and
    ``maybe_wait_for_saving`` waits for it and clears it."""
    parts = _build(tmp_path)
    ckpt = parts["checkpointer"]
    try:
        _train(parts, 2)
        assert ckpt.save_future is not None
        ckpt.maybe_wait_for_saving()
        assert ckpt.save_future is None
        assert ckpt.manager.all_steps() == [1, 2]
    finally:
        ckpt.close()


def test_exclude_from_loading_keeps_live_states(tmp_path: Path) -> None:
    """States named in ``exclude_from_loading`` keep their live values; the rest load."""
    parts = _build(tmp_path, async_mode="disabled")
    _train(parts, 2)
    parts["checkpointer"].close()
    saved_lr = parts["schedulers"].state_dict()["last_epoch"]
    other = _build(tmp_path, exclude_from_loading=["lr_scheduler", "optimizer", "dataloader"])
    ckpt = other["checkpointer"]
    try:
        assert ckpt.load() is True
        assert other["state"].step == 2  # train_state loaded
        _same(other["model"].state_dict(), parts["model"].state_dict())
        assert other["schedulers"].state_dict()["last_epoch"] == 0 != saved_lr
        assert not other["optimizers"].optimizers[0].state  # never stepped, nothing loaded
    finally:
        ckpt.close()


def test_load_only_never_saves(tmp_path: Path) -> None:
    parts = _build(tmp_path, load_only=True)
    ckpt = parts["checkpointer"]
    try:
        _train(parts, 3)
        assert ckpt.manager.all_steps() == []
    finally:
        ckpt.close()


class _Got:
    """Records what a restore loads."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def test_last_save_model_only_in_export_dtype(tmp_path: Path) -> None:
    """The last step's save holds the model alone, cast to ``export_dtype``, in the run
    ``<run_id>-model``; the training run keeps its interval saves."""
    parts = _build(tmp_path, interval=2, last_save_model_only=True, export_dtype="bfloat16")
    ckpt = parts["checkpointer"]
    try:
        _train(parts, 3)
        ckpt.maybe_wait_for_saving()
        assert ckpt.manager.all_steps() == [2]
    finally:
        ckpt.close()
    got = _Got()
    with CheckpointManager(config_from_dict({"checkpointing": {
            "runs_path": str(tmp_path / "checkpoint"), "run_id": "torchtitan-model"}}),
            {"model": got}) as reader:
        assert reader.all_steps() == [3]
        reader.restore_sync("latest", load="model")
    want = parts["model"].state_dict()
    assert got.sd.keys() == want.keys()
    for k, v in want.items():
        assert got.sd[k].dtype == torch.bfloat16 and torch.equal(got.sd[k], v.bfloat16()), k


def test_initial_load_from_a_torchtitan_dcp_checkpoint(tmp_path: Path) -> None:
    """A job moves from torchtitan's DCP manager: ``initial_load_path`` names its last
    ``step-N`` folder, and the first load (no version yet) reads it."""
    from torchtitan.components.checkpointer import CheckpointManager as DcpManager

    parts = _build(tmp_path / "dcp", async_mode="disabled")
    _train(parts, 2)
    parts["checkpointer"].close()
    dcp_mgr = DcpManager.Config(enable=True, folder="dcp", keep_latest_k=0,
                                last_save_model_only=False).build(
        dataloader=parts["loader"], model_parts=[parts["model"]],
        optimizers=parts["optimizers"], lr_schedulers=parts["schedulers"],
        states={"train_state": parts["state"]}, sd_adapter=None, base_folder=str(tmp_path))
    dcp_mgr.save(2, last_step=True)
    dcp_mgr.close()
    step_dir = tmp_path / "dcp" / "step-2"
    for model_only, step in ((True, 0), (False, 2)):
        new = _build(tmp_path / f"new-{model_only}", initial_load_path=str(step_dir),
                     initial_load_model_only=model_only)
        try:
            assert new["checkpointer"].load() is True
            _same(new["model"].state_dict(), parts["model"].state_dict())
            assert new["state"].step == step
        finally:
            new["checkpointer"].close()


def test_initial_load_from_a_mithril_run(tmp_path: Path) -> None:
    parts = _build(tmp_path / "a", async_mode="disabled")
    _train(parts, 2)
    parts["checkpointer"].close()
    new = _build(tmp_path / "b", initial_load_path=str(tmp_path / "a" / "checkpoint"
                                                         / "torchtitan"),
                 initial_load_model_only=False)
    try:
        assert new["checkpointer"].load() is True
        assert new["state"].step == 2
        _same(new["model"].state_dict(), parts["model"].state_dict())
    finally:
        new["checkpointer"].close()


@pytest.mark.parametrize(("fields", "named"), [
    ({"last_save_in_hf": True, "last_save_model_only": True}, "last_save_in_hf"),
    ({"initial_load_in_hf": True}, "initial_load_in_hf"),
    ({"create_seed_checkpoint": True}, "create_seed_checkpoint"),
    ({"folder": "s3://bucket/ckpt"}, "folder"),
    ({"async_mode": "sometimes"}, "async_mode"),
    ({"mithril": {"checkpointing": {"runs_path": "x"}}}, "runs_path"),
    ({"mithril": {"checkpointing": {"ckpting_save_iter": 3}}}, "ckpting_save_iter"),
    ({"mithril": {"checkpointing": {"keep_last": 3}}}, "keep_last"),
    ({"mithril": {"checkpointing": {"no_such_key": 1}}}, "no_such_key"),
    ({"mithril": 5}, "checkpoint.mithril"),
])
def test_refused_fields_are_named(tmp_path: Path, fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _build(tmp_path, **fields)["checkpointer"].close()


def test_unknown_exclude_from_loading_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exclude_from_loading"):
        _build(tmp_path, exclude_from_loading=["no_such_state"])


def test_mithril_toml_path(tmp_path: Path) -> None:
    """The mithril configuration as a TOML file: its keys reach the manager."""
    toml = tmp_path / "mithril.toml"
    toml.write_text('[checkpointing]\nrun_id = "job7"\n[checkpointing.compression]\nlevel = 5\n')
    parts = _build(tmp_path, mithril=str(toml))
    ckpt = parts["checkpointer"]
    try:
        assert ckpt.manager.run_id == "job7"
        assert ckpt.manager.cfg.compression.level == 5
        assert ckpt.manager.cfg.runs_path == str(tmp_path / "checkpoint")
    finally:
        ckpt.close()


def test_disabled_manager_does_nothing(tmp_path: Path) -> None:
    parts = script.build(str(tmp_path), Cfg(enable=False), 3)
    ckpt = parts["checkpointer"]
    assert ckpt.load() is False and ckpt.save(1, last_step=True) is False
    ckpt.close()
    assert not (tmp_path / "checkpoint").exists()
