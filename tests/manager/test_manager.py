"""CheckpointManager end to end on local disk: layout, roundtrip, aliases, errors, facade."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from mithril_async import (
    CheckpointManager,
    ChecksumMismatch,
    Config,
    SaveFailed,
    SaveInProgress,
    StepAlreadyExists,
    TensorDict,
    VersionNotFound,
)
from mithril_async.storage.memory import MemoryStore
from tests.manager.conftest import make_state, state_equal, train_step

ConfigFactory = Callable[..., Config]


@pytest.fixture(params=["inline", "worker"])
def make_config(request: pytest.FixtureRequest, make_config: ConfigFactory,
                make_worker_config: ConfigFactory) -> ConfigFactory:
    """Every test of this module runs with the save's background part inline and in a
    checkpoint worker process (a test passing its own store runs inline either way)."""
    return make_worker_config if request.param == "worker" else make_config


def _deepcopy_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}


@pytest.mark.parametrize("compressed", [True, False])
def test_save_restore_roundtrip_bitwise(make_config: ConfigFactory, tmp_path: Path,
                                        compressed: bool) -> None:
    cfg = make_config(f"[checkpointing.compression]\nenabled = {str(compressed).lower()}\n",
                      best_metric_name="loss")
    model, opt, batcher = make_state()
    state = {"model": model, "optimizer": opt, "batcher": batcher}

    async def run() -> dict[str, Any]:
        async with CheckpointManager(cfg, state) as m:
            for step in range(1, 4):
                loss = train_step(model, opt, batcher)
                await m.save(step, metrics={"loss": loss})
            await m.wait_until_finished()
            assert m.all_steps() == [1, 2, 3]
            assert m.latest_step() == 3
        return _deepcopy_state(model, opt)

    saved = asyncio.run(run())
    for _ in range(3):
        train_step(model, opt, batcher)
    assert not state_equal(saved["model"], model.state_dict())

    m2 = CheckpointManager(cfg, state)
    assert m2.restore_sync("latest") == 3
    m2.close()
    assert state_equal(saved["model"], model.state_dict())
    assert state_equal(saved["opt"], opt.state_dict())
    assert batcher.position == 3

    vdir = tmp_path / "runs" / "run1" / "versions" / "v000003"
    names = {p.name for p in vdir.iterdir()}
    model_name = "model.mckp" if compressed else "model.safetensors"
    assert {model_name, "opt_shard_rank0000.bin", "rng_rank0000.json", "manifest.json"} <= names
    manifest = json.loads((vdir / "manifest.json").read_text())
    assert manifest["model"]["key"] == f"runs/run1/versions/v000003/{model_name}"
    assert manifest["optimizer"]["shards"][0]["key"].endswith("opt_shard_rank0000.bin")
    assert manifest["resume"] == {"base_step": 3, "exact": True}
    assert manifest["schema_version"] == 1 and manifest["step"] == 3
    assert set(manifest["paths"]) >= {"layout_version", "root_local"}
    if not compressed:
        with safe_open(str(vdir / model_name), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert torch.equal(f.get_tensor(k), saved["model"][k])
    else:
        assert (vdir / model_name).read_bytes()[:4] == b"MCKP"
        assert manifest["stats"]["bytes_out"] < manifest["stats"]["bytes_in"]
    run_dir = tmp_path / "runs" / "run1"
    assert (run_dir / "config" / "train.toml").read_text() == cfg.source_toml
    assert json.loads((run_dir / "config" / "config.json").read_text())["checkpointing"]
    run_json = json.loads((run_dir / "run.json").read_text())
    assert [v["step"] for v in run_json["versions"]] == [1, 2, 3]
    best = json.loads((run_dir / "aliases" / "best.json").read_text())
    assert best["status"] == "ok" and best["metric_name"] == "loss"


def test_best_alias_pending_until_metric_and_tracks_min(make_config: ConfigFactory,
                                                        tmp_path: Path) -> None:
    cfg = make_config(best_metric_name="val_loss", best_mode="min")
    model, opt, _ = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        best = tmp_path / "runs" / "run1" / "aliases" / "best.json"
        assert json.loads(best.read_text())["status"] == "pending"
        m.save_nowait(1).result()
        assert json.loads(best.read_text())["status"] == "pending"
        assert m.best_step() is None
        for step, v in [(2, 0.5), (3, 0.7), (4, 0.2), (5, float("nan")), (6, 0.3)]:
            m.save_nowait(step, metrics={"val_loss": v}).result()
        assert m.best_step() == 4
        assert m.latest_step() == 6
        assert m.restore_sync("best") == 4
        assert m.restore_sync("v000002") == 2
        assert m.restore_sync(3) == 3
        assert m.restore_sync("runs/run1/versions/v000005/manifest.json") == 5
        for bad in ("v000099", 77, "nonsense", "runs/other/versions/v000001/manifest.json"):
            with pytest.raises(VersionNotFound):
                m.restore_sync(bad)


def test_step_already_exists_and_nothing_overwritten(make_config: ConfigFactory) -> None:
    cfg = make_config()
    model, _opt, _ = make_state()
    with CheckpointManager(cfg, {"model": model}) as m:
        m.save_nowait(5).result()
        with pytest.raises(StepAlreadyExists) as info:
            m.save_nowait(5)
        assert isinstance(info.value, FileExistsError)
    with CheckpointManager(cfg, {"model": model}) as m2, pytest.raises(StepAlreadyExists):
        m2.save_nowait(5)


def test_retention_keeps_last_best_every_and_aliases(make_config: ConfigFactory) -> None:
    cfg = make_config(keep_last=2, keep_best=1, keep_every_n_steps=10,
                      best_metric_name="loss")
    model, _opt, _ = make_state()
    losses = {5: 0.1, 10: 0.9, 15: 0.8, 20: 0.7, 25: 0.6, 30: 0.5}
    with CheckpointManager(cfg, {"model": model}) as m:
        for step, loss in losses.items():
            m.save_nowait(step, metrics={"loss": loss}).result()
        assert m.all_steps() == [5, 10, 20, 25, 30]  # best 5, every-10, last two


class _FailingStore(MemoryStore):
    """A memory store whose blob writers fail after ``fail_after`` writes while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def open_writer(self, key: str) -> Any:
        inner = super().open_writer(key)
        outer = self

        class W:
            def __init__(self) -> None:
                self.key = key

            async def write(self, data: Any) -> None:
                if outer.armed:
                    raise OSError(28, "No space left on device (injected)")
                await inner.write(data)

            async def commit(self) -> int:
                return await inner.commit()

            async def abort(self) -> None:
                await inner.abort()

        return W()


def test_failed_save_is_raised_later_and_previous_version_survives(
        make_config: ConfigFactory) -> None:
    store = _FailingStore()
    cfg = make_config()
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}, store=store) as m:
        m.save_nowait(1).result()
        good = copy.deepcopy(model.state_dict())
        train_step(model, opt, batcher)
        store.armed = True
        handle = m.save_nowait(2)
        with pytest.raises(OSError, match="injected"):
            handle.result()
        with pytest.raises(SaveFailed, match="injected"):
            m.save_nowait(3)
        assert not [k for k in asyncio.run(store.list("runs/run1/versions/v000002/"))]
        assert m.all_steps() == [1]
        assert m.latest_step() == 1
        store.armed = False
        m.save_nowait(3).result()  # the manager stays usable
        assert m.all_steps() == [1, 3]
        m.restore_sync(1)
        assert state_equal(good, model.state_dict())


def test_on_busy_skip_and_error(make_config: ConfigFactory) -> None:
    model, _opt, _ = make_state()
    gate = threading.Event()

    class SlowStore(MemoryStore):
        async def put_if_absent(self, key: str, data: Any) -> None:
            if key.endswith("manifest.json"):
                while not gate.is_set():
                    await asyncio.sleep(0.005)
            await super().put_if_absent(key, data)

    for mode in ("skip", "error"):
        gate.clear()
        cfg = make_config(f'[checkpointing.pipeline]\non_busy = "{mode}"\n')
        with CheckpointManager(cfg, {"model": model}, store=SlowStore()) as m:
            first = m.save_nowait(1)
            if mode == "skip":
                second = m.save_nowait(2)
                assert second.skipped and second.result().status == "skipped"
            else:
                with pytest.raises(SaveInProgress):
                    m.save_nowait(2)
            gate.set()
            assert first.result().status == "committed"
            assert m.all_steps() == [1]


def test_save_returns_before_commit_and_progresses_while_training(
        make_config: ConfigFactory) -> None:
    """The pipeline runs on its own thread: the commit happens while the caller computes.

    The manifest's publication is held until the caller has its handle back, so save_nowait()
    provably returned before the commit; then the commit lands while this thread only
    computes (it never calls into the manager until the handle is done)."""
    cfg = make_config()
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    returned = threading.Event()

    class HeldStore(MemoryStore):
        async def put_if_absent(self, key: str, data: Any) -> None:
            if key.endswith("manifest.json"):
                assert await asyncio.to_thread(returned.wait, 60), "save_nowait never returned"
            await super().put_if_absent(key, data)

    with CheckpointManager(cfg, {"model": model}, store=HeldStore()) as m:
        handle = m.save_nowait(1)
        assert not handle.done()  # nothing is committed before save_nowait() returns
        returned.set()
        deadline = time.monotonic() + 60  # a safety net only: the commit needs no help
        x = torch.randn(256, 1024)
        while not handle.done() and time.monotonic() < deadline:
            x = torch.tanh(x @ model.weight.detach())  # the "training loop" keeps computing
        assert handle.done()
        res = handle.result()
        assert res.status == "committed" and res.total_s >= res.stall_s
        assert res.bytes_in == 1024 * 1024 * 4 + 1024 * 4 and res.ratio > 1.0


def test_input_state_never_mutated_and_buffers_reused(make_config: ConfigFactory) -> None:
    cfg = make_config()
    model, opt, batcher = make_state()
    train_step(model, opt, batcher)
    before = _deepcopy_state(model, opt)
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        ptrs = {k: t.data_ptr() for k, t in m._ctx.chains["model"].areas[0].buffers.items()}
        m.save_nowait(2).result()
        assert ptrs == {k: t.data_ptr() for k, t in m._ctx.chains["model"].areas[0].buffers.items()}
    assert state_equal(before["model"], model.state_dict())
    assert state_equal(before["opt"], opt.state_dict())


def test_corrupt_blob_raises_and_fallback_loads_older(make_config: ConfigFactory,
                                                      tmp_path: Path) -> None:
    cfg = make_config()
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        v1 = copy.deepcopy(model.state_dict())
        train_step(model, opt, batcher)
        m.save_nowait(2).result()
    blob = tmp_path / "runs" / "run1" / "versions" / "v000002" / "model.mckp"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        with pytest.raises(ChecksumMismatch, match=r"v000002/model\.mckp"):
            m.restore_sync("latest", verify="whole")  # the blob's own error, nothing written
        assert m.restore_sync("latest", fallback=True) == 1
    assert state_equal(v1, model.state_dict())


def test_unfinished_save_leftovers_ignored_and_cleaned(make_config: ConfigFactory,
                                                       tmp_path: Path) -> None:
    cfg = make_config()
    model, _, _ = make_state()
    with CheckpointManager(cfg, {"model": model}) as m:
        m.save_nowait(1).result()
    # a save killed after its blob, before its manifest: claim of a dead process
    vdir = tmp_path / "runs" / "run1" / "versions" / "v000002"
    vdir.mkdir()
    (vdir / "_claim.json").write_text(json.dumps({"host": "elsewhere", "pid": 1, "t": 0}))
    (vdir / "model.mckp").write_bytes(b"partial")
    tmp_file = vdir.parent / "v000001" / ".tmp-model.mckp.abc"
    tmp_file.write_bytes(b"temp")
    os.utime(tmp_file, (time.time() - 3600, time.time() - 3600))  # a writer killed long ago
    young = vdir.parent / "v000001" / ".tmp-other-writer"
    young.write_bytes(b"another live writer")
    with CheckpointManager(cfg, {"model": model}) as m:
        assert m.all_steps() == [1]
        assert not vdir.exists()
        assert not tmp_file.exists()
        if cfg.checkpointing.pipeline.process == "worker":
            # v000001's claim names the worker that wrote it, which has exited: what lies in
            # its committed folder is a dead writer's, removed whatever its age
            assert not young.exists()
        else:
            assert young.exists()  # may belong to a live writer (v000001's): left alone
        m.save_nowait(2).result()
        assert m.all_steps() == [1, 2]


def test_bad_state_and_step_arguments(make_config: ConfigFactory) -> None:
    cfg = make_config()
    model, _, _ = make_state()
    with CheckpointManager(cfg, {"net": model}):  # no "model" entry is needed
        pass
    with pytest.raises(TypeError, match="state\\['x'\\]"):  # UnsupportedStateType
        CheckpointManager(cfg, {"model": model, "x": object()})
    with CheckpointManager(cfg, {"model": model}) as m:
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="step"):
                m.save_nowait(bad)  # type: ignore[arg-type]


def test_should_save_and_the_current_run(make_config: ConfigFactory, tmp_path: Path) -> None:
    cfg = make_config()
    cfg.checkpointing.ckpting_save_iter = 10
    cfg.checkpointing.run_id = None
    model, _, _ = make_state()
    a = CheckpointManager(cfg, {"model": model})
    b = CheckpointManager(cfg, {"model": model})  # no run_id: the folder's current run
    fresh = cfg.model_copy(deep=True)
    fresh.checkpointing.new_run = True
    c = CheckpointManager(fresh, {"model": model})
    assert a.run_id == b.run_id != c.run_id
    assert [s for s in range(31) if a.should_save(s)] == [10, 20, 30]
    for m in (a, b, c):
        m.close()


def test_resume_optimizer_false_leaves_optimizer_alone(make_config: ConfigFactory) -> None:
    cfg = make_config(resume_optimizer=False)
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        train_step(model, opt, batcher)
        m.save_nowait(1).result()
        saved_model = copy.deepcopy(model.state_dict())
        train_step(model, opt, batcher)
        opt_after = copy.deepcopy(opt.state_dict())
        m.restore_sync("latest")
    assert state_equal(saved_model, model.state_dict())
    assert state_equal(opt_after, opt.state_dict())  # optimizer state was not loaded



@pytest.mark.parametrize(("auto", "mib", "want_chunk"), [
    (True, 16, 1 << 20),           # 16 MiB state: 1/32 is 512 KiB -> the 1 MiB floor
    (True, 64, 2 << 20),           # 64 MiB: 1/32 = 2 MiB
    (False, 16, 4 << 20),          # off: the configured 4 MiB
    (True, 160, 4 << 20),          # >= 32 configured chunks: unchanged
])
def test_small_states_get_smaller_chunks_and_restore_exactly(
        make_config: ConfigFactory, tmp_path: Path, auto: bool, mib: int,
        want_chunk: int) -> None:
    from mithril_async.codec.state_dict import read_info

    cfg = make_config(f"[checkpointing.compression]\nauto_chunk = {str(auto).lower()}\n")
    g = torch.Generator().manual_seed(mib)
    sd = {"w": torch.randn(mib << 18, generator=g), "b": torch.randn(7, generator=g)}
    saved = {k: v.clone() for k, v in sd.items()}
    with CheckpointManager(cfg, {"model": TensorDict(sd)}) as m:
        m.save_nowait(1).result()
    blob = (tmp_path / "runs" / "run1" / "versions" / "v000001" / "model.mckp").read_bytes()
    info = read_info(blob)
    assert info.params["chunk_bytes"] == want_chunk
    w = next(t for t in info.tensors if t.name == "w")
    assert {n for _, n in w.chunks} == {want_chunk}  # 4 bytes divide every size here
    for v in sd.values():
        v.zero_()
    m2 = CheckpointManager(cfg, {"model": TensorDict(sd)})
    assert m2.restore_sync("latest") == 1
    m2.close()
    assert all(torch.equal(sd[k], saved[k]) for k in sd)
