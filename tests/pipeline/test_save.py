"""SaveJob: one object per save; what saves share lives in a SaveContext, not on the manager."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, Config, TensorDict
from mithril_async.catalog import RunCatalog
from mithril_async.config import CheckpointingConfig
from mithril_async.errors import KeyNotFound
from mithril_async.layout import RunLayout
from mithril_async.pipeline.pool import CodecPool
from mithril_async.restore.reader import VersionReader
from mithril_async.save.context import SaveContext
from mithril_async.save.coordinator import LocalCoordinator
from mithril_async.save.job import SaveJob
from mithril_async.save.writers import BlobEncoder
from mithril_async.save.xor_chain import ChainPolicy
from mithril_async.storage.memory import MemoryStore
from tests.manager.conftest import make_state, train_step


@pytest.mark.parametrize("snapshot", ["blocking", "overlapped"])
def test_saves_leave_no_state_on_the_manager(make_config: Any, snapshot: str) -> None:
    """Every attribute the manager has after saves and a restore it had after __init__
    (lazily made ones aside: the loop thread and, overlapped, the step guard)."""
    model, opt, batcher = make_state()
    cfg = make_config(f'[checkpointing.pipeline]\nsnapshot = "{snapshot}"\n', keep_last=2)
    m = CheckpointManager(cfg, {"model": model, "optimizer": opt, "data": batcher})
    before = set(vars(m))
    with m:
        for step in range(1, 5):
            train_step(model, opt, batcher)
            m.save_nowait(step)
        m.wait()
        m.restore_sync("latest")
    assert set(vars(m)) == before
    assert [r.status for r in m.history] == ["committed"] * 4


def _context(store: MemoryStore, state: dict[str, Any],
             pool: CodecPool) -> SaveContext:
    cfg = Config(checkpointing=CheckpointingConfig())
    layout = RunLayout("runs", "job")
    comp = cfg.checkpointing.compression
    return SaveContext(
        config=cfg, state=state, store=store, layout=layout,
        catalog=RunCatalog(store, layout), coordinator=LocalCoordinator(), pool=pool,
        encoder=BlobEncoder(comp, cfg.checkpointing.pipeline, pool),
        chain_policy=ChainPolicy(delta=False, dedup=False, keyframe_interval=8,
                                 delta_base="previous", min_gain=0.0, byte_grouping=True),
        retention=None, steps=set())


async def _save(ctx: SaveContext, step: int) -> Any:
    job = SaveJob(ctx, step, time.perf_counter())
    for snap in job.snapshot(frozenset(), None):
        await snap.wait()
    job.begin({"step": step}, 0.0)
    return await job.run()


def test_a_save_job_runs_on_a_context_alone() -> None:
    """No manager: a context over a MemoryStore, two jobs, read back by the reader."""
    weights = TensorDict({"w": torch.arange(4096, dtype=torch.float32)})
    store = MemoryStore()
    with CodecPool(2) as pool:
        ctx = _context(store, {"model": weights}, pool)
        first = asyncio.run(_save(ctx, 10))
        saved = weights.tensors["w"].clone()
        weights.tensors["w"].add_(1)  # the next save sees the change; the first is kept
        second = asyncio.run(_save(ctx, 20))
        assert (first.version_id, second.version_id) == ("v000001", "v000002")
        assert ctx.steps == {10, 20} and [r.step for r in ctx.history] == [10, 20]
        with VersionReader(ctx.catalog) as reader:
            v1 = asyncio.run(reader.read_version("v000001"))
            v2 = asyncio.run(reader.read_version("latest"))
    assert torch.equal(v1.trees["model"]["w"], saved)
    assert torch.equal(v2.trees["model"]["w"], saved + 1)
    assert v2.manifest.metrics == {"step": 20}


class _NoManifest(MemoryStore):
    """put_if_absent of a manifest fails while ``broken``."""

    broken = True

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if self.broken and key.endswith("/manifest.json"):
            raise KeyNotFound(f"{key}: injected")
        await super().put_if_absent(key, data)


def test_a_commit_error_is_raised_as_itself_and_stays_with_its_job() -> None:
    weights = TensorDict({"w": torch.ones(1024)})
    store = _NoManifest()
    with CodecPool(2) as pool:
        ctx = _context(store, {"model": weights}, pool)
        with pytest.raises(KeyNotFound, match="injected"):
            asyncio.run(_save(ctx, 1))
        assert ctx.history[-1].status == "failed"
        assert not [k for k in asyncio.run(store.list("runs/")) if "/versions/" in k]
        store.broken = False
        res = asyncio.run(_save(ctx, 2))  # nothing of the failed job leaks into this one
    assert res.status == "committed" and res.version_id is not None
    assert ctx.steps == {2}
