"""SparseDeltaRecorder + reconstruct_weights_at_step on real (tiny) training runs."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from mithril_async.errors import (
    MissingPrevious,
    MithrilError,
    SaveFailed,
    ShapeMismatch,
    StepAlreadyExists,
    StorageError,
    UnsupportedDtype,
    VersionNotFound,
)
from mithril_async.step_deltas import (
    SparseDeltaRecorder,
    load_sparse_delta,
    read_metadata,
    reconstruct_weights_at_step,
)
from mithril_async.storage.local import LocalStore
from tests.step_deltas._training import TinyLM, bits_equal, make_optimizer, snapshot, train

STEPS = 16
CHECK_AT = (1, 2, 7, STEPS)


class SlowStore:
    """Delegates to a LocalStore after sleeping in every put (writes fall behind); with
    ``held``, puts of delta files wait until it is set (writes held back by the test)."""

    def __init__(self, root: Path, delay: float, held: threading.Event | None = None) -> None:
        self.inner = LocalStore(root, durable=False)
        self.delay = delay
        self.held = held
        self.puts: list[str] = []

    async def put(self, key: str, data: bytes | memoryview) -> None:
        if self.held is not None and key.startswith("delta_"):
            await asyncio.to_thread(self.held.wait)
        await asyncio.sleep(self.delay)
        await self.inner.put(key, data)
        self.puts.append(key)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def close(self) -> None:
        await self.inner.close()


class FailingStore(SlowStore):
    """Fails the put of one key (and only that one); with ``gate``, only once it is set, so
    whatever is recorded meanwhile queues behind the failing write however fast training is."""

    def __init__(self, root: Path, fail_key: str, delay: float = 0.0,
                 gate: threading.Event | None = None) -> None:
        super().__init__(root, delay)
        self.fail_key = fail_key
        self.gate = gate

    async def put(self, key: str, data: bytes | memoryview) -> None:
        if key == self.fail_key:
            if self.gate is not None:
                await asyncio.to_thread(self.gate.wait)
            raise StorageError(f"injected failure writing {key}")
        await super().put(key, data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_reconstruct_is_bitwise_exact(tmp_path: Path, dtype: torch.dtype, optim: str) -> None:
    torch.manual_seed(1)
    model = TinyLM()
    opt = make_optimizer(model, optim)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}  # fp32 originals
    store = LocalStore(tmp_path, durable=False)
    rec = SparseDeltaRecorder(model, tmp_path, dtype=dtype, store=store)
    snaps: dict[int, dict[str, torch.Tensor]] = {}

    def after(step: int) -> None:
        rec.record(step)
        if step in CHECK_AT:
            snaps[step] = snapshot(model, dtype)

    train(model, opt, STEPS, after)
    rec.close()

    for step in CHECK_AT:
        got = reconstruct_weights_at_step(base, tmp_path, step)
        assert set(got) == set(snaps[step])
        for name, want in snaps[step].items():
            assert bits_equal(got[name], want), (optim, dtype, step, name)
    # the base stored by the recorder gives the same result as the caller's base
    stored = reconstruct_weights_at_step(None, tmp_path, STEPS)
    assert all(bits_equal(stored[k], snaps[STEPS][k]) for k in stored)

    # frozen parameters never appear in any delta; SGD leaves unused embedding rows alone
    meta = read_metadata(tmp_path)
    for entry in meta["checkpoints"]:
        layers = load_sparse_delta(tmp_path / entry["path"], dense=False)
        assert not any(name.startswith("frozen.") for name in layers)
        assert sum(d.nnz for d in layers.values()) == entry["nonzero"]
    if optim == "sgd":
        assert all(e["sparsity"] > 0.3 for e in meta["checkpoints"])


def test_metadata_json(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = TinyLM()
    opt = make_optimizer(model, "sgd")
    with SparseDeltaRecorder(model, tmp_path, dtype=torch.bfloat16) as rec:
        train(model, opt, 5, lambda s: rec.record(10 * s))
    meta = json.loads((tmp_path / "metadata.json").read_text())
    total = sum(p.numel() for p in model.parameters())
    assert meta["format"] == "mithril-sparse-delta" and meta["format_version"] == 1
    assert meta["total_params"] == total
    assert meta["dtype"] == "torch.bfloat16"
    assert meta["encoding"] == "mckp"
    assert meta["base"] == "base.mckp" and (tmp_path / "base.mckp").exists()
    assert meta["layers"]["embed.weight"] == {"shape": [64, 16], "numel": 1024}
    assert [e["step"] for e in meta["checkpoints"]] == [10, 20, 30, 40, 50]
    for e in meta["checkpoints"]:
        assert e["path"] == f"delta_{e['step']:06d}.mckp"
        assert (tmp_path / e["path"]).stat().st_size == e["bytes"]
        assert 0.0 <= e["sparsity"] <= 1.0
        assert e["sparsity"] == pytest.approx(1 - e["nonzero"] / total)
        assert e["changed_layers"] >= 1 and e["update_l2"] > 0
    # dense seed-003 view: non-zeros of the dense delta are the changed positions
    dense = load_sparse_delta(tmp_path / "delta_000010.mckp")
    assert dense["embed.weight"].shape == (64, 16)
    nz = sum(int((t != 0).sum()) for t in dense.values())
    assert nz == meta["checkpoints"][0]["nonzero"]


def test_unrecorded_step_and_bad_inputs(tmp_path: Path) -> None:
    model = TinyLM()
    opt = make_optimizer(model, "sgd")
    rec = SparseDeltaRecorder(model, tmp_path, dtype=torch.float32, base_step=0)
    train(model, opt, 3, lambda s: rec.record(2 * s))
    with pytest.raises(ValueError, match="steps must increase"):
        rec.record(6)
    rec.close()
    rec.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        rec.record(100)
    with pytest.raises(VersionNotFound, match="step 3 was not recorded"):
        reconstruct_weights_at_step(None, tmp_path, 3)
    base = reconstruct_weights_at_step(None, tmp_path, 0)  # the declared base step
    assert bits_equal(base["head.weight"], load_base_head(tmp_path))
    with pytest.raises(StepAlreadyExists):
        SparseDeltaRecorder(model, tmp_path)
    with pytest.raises(UnsupportedDtype):
        SparseDeltaRecorder(model, tmp_path / "x", dtype=torch.int32)
    with pytest.raises(VersionNotFound):
        reconstruct_weights_at_step(None, tmp_path / "missing", 1)


def load_base_head(path: Path) -> torch.Tensor:
    from mithril_async.codec import decompress_state_dict

    blob = (path / "base.mckp").read_bytes()
    t: torch.Tensor = decompress_state_dict(blob)["head.weight"]
    return t


def _nudge(model: TinyLM, by: float) -> None:
    """A weight change for record() to find (no optimizer needed)."""
    with torch.no_grad():
        model.head.bias.add_(by)


def test_backpressure_record_returns_fast(tmp_path: Path) -> None:
    """With every delta write held back, record() returns at once until ``max_pending``
    deltas are queued; the next one waits for a slot (bounded memory) instead of queueing
    without limit, and goes on once a write finishes."""
    model = TinyLM()
    release = threading.Event()
    store = SlowStore(tmp_path, delay=0.0, held=release)
    rec = SparseDeltaRecorder(model, tmp_path, dtype=torch.bfloat16, store=store, max_pending=2)
    blocked: list[float] = []
    for step in (1, 2):  # returns although no delta write can finish: never waits for one
        _nudge(model, 1.0)
        blocked.append(rec.record(step).blocked_seconds)
    assert rec._queued == 2 and not [k for k in store.puts if k.startswith("delta_")]
    third: list[float] = []
    _nudge(model, 1.0)
    waiter = threading.Thread(target=lambda: third.append(rec.record(3).blocked_seconds))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and rec._queued == 2  # the queue is full: record(3) waits
    release.set()
    waiter.join(timeout=120)
    assert not waiter.is_alive() and third[0] > 0.0
    assert rec._queued <= 2
    rec.close()
    assert sorted(k for k in store.puts if k.startswith("delta_")) == [
        f"delta_{s:06d}.mckp" for s in range(1, 4)
    ]
    assert len(read_metadata(tmp_path)["checkpoints"]) == 3
    assert rec.blocked_seconds == pytest.approx(sum(blocked) + third[0])


def test_record_does_not_wait_for_writes(tmp_path: Path) -> None:
    """With room in the queue, record() returns before the (held back) write is durable."""
    model = TinyLM()
    release = threading.Event()
    store = SlowStore(tmp_path, delay=0.0, held=release)
    rec = SparseDeltaRecorder(model, tmp_path, store=store, max_pending=8)
    _nudge(model, 1.0)
    rec.record(1)  # would never return if it waited for the write
    assert not (tmp_path / "delta_000001.mckp").exists()
    release.set()
    rec.close()
    assert (tmp_path / "delta_000001.mckp").exists()


def test_background_error_surfaces(tmp_path: Path) -> None:
    model = TinyLM()
    opt = make_optimizer(model, "sgd")
    store = FailingStore(tmp_path, fail_key="delta_000003.mckp")
    rec = SparseDeltaRecorder(model, tmp_path, store=store, max_pending=1)
    train(model, opt, 3, rec.record)
    deadline = time.monotonic() + 60  # a safety net: failed is set once the write fails
    while not rec.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(SaveFailed) as info:
        rec.record(4)
    assert isinstance(info.value.__cause__, StorageError)
    assert isinstance(info.value, MithrilError)
    with pytest.raises(SaveFailed):  # sticky: the chain is broken
        rec.record(5)
    rec.close()  # already reported: close does not raise again
    steps = [e["step"] for e in read_metadata(tmp_path)["checkpoints"]]
    assert steps == [1, 2]  # never lists the lost step
    assert not (tmp_path / "delta_000004.mckp").exists()


def test_error_surfaces_on_close(tmp_path: Path) -> None:
    model = TinyLM()
    store = FailingStore(tmp_path, fail_key="delta_000001.mckp")
    rec = SparseDeltaRecorder(model, tmp_path, store=store)
    with torch.no_grad():
        model.head.weight.mul_(2)
    rec.record(1)
    with pytest.raises(SaveFailed):
        rec.close()
    assert os.listdir(tmp_path)  # base + metadata still written


def test_backpressure_by_bytes(tmp_path: Path) -> None:
    """A byte budget smaller than one delta still admits one at a time, never more."""
    model = TinyLM()
    opt = make_optimizer(model, "adamw")
    store = SlowStore(tmp_path, delay=0.05)
    rec = SparseDeltaRecorder(model, tmp_path, store=store, max_pending=8, max_pending_bytes=1)
    seen: list[int] = []

    def after(step: int) -> None:
        rec.record(step)
        seen.append(rec._queued)

    train(model, opt, 4, after)
    rec.close()
    assert max(seen) == 1
    assert len(read_metadata(tmp_path)["checkpoints"]) == 4


def test_reconstruct_refuses_wrong_base_and_missing_files(tmp_path: Path) -> None:
    model = TinyLM()
    opt = make_optimizer(model, "sgd")
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    with SparseDeltaRecorder(model, tmp_path, dtype=torch.float32, save_base=False) as rec:
        train(model, opt, 3, rec.record)
    assert read_metadata(tmp_path)["base"] is None
    with pytest.raises(MissingPrevious, match="no stored base"):
        reconstruct_weights_at_step(None, tmp_path, 3)
    wrong = {**base, "head.weight": torch.zeros(3, 3)}
    with pytest.raises(ShapeMismatch, match=r"head\.weight"):
        reconstruct_weights_at_step(wrong, tmp_path, 3)
    partial = {k: v for k, v in base.items() if k != "embed.weight"}
    with pytest.raises(MissingPrevious, match=r"embed\.weight"):
        reconstruct_weights_at_step(partial, tmp_path, 3)
    extra = {**base, "buffer": torch.arange(3)}  # untracked entries pass through unchanged
    got = reconstruct_weights_at_step(extra, tmp_path, 3)
    assert torch.equal(got["buffer"], torch.arange(3))
    (tmp_path / "delta_000002.mckp").unlink()
    with pytest.raises(MissingPrevious, match="step 2"):
        reconstruct_weights_at_step(base, tmp_path, 3)
    assert reconstruct_weights_at_step(base, tmp_path, 1)["head.bias"].dtype == torch.float32


def test_failure_with_queued_steps_keeps_an_intact_prefix(tmp_path: Path) -> None:
    """Steps queued behind a failed one are never written (they would skip the lost step);
    the durable steps before it are listed in metadata.json and reconstruct exactly."""
    model = TinyLM()
    opt = make_optimizer(model, "adamw")
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    trained = threading.Event()
    store = FailingStore(tmp_path, fail_key="delta_000003.mckp", gate=trained)
    rec = SparseDeltaRecorder(model, tmp_path, store=store, max_pending=16)
    snaps: dict[int, dict[str, torch.Tensor]] = {}

    def after(step: int) -> None:
        rec.record(step)
        snaps[step] = snapshot(model, torch.bfloat16)

    try:
        train(model, opt, 8, after)
    finally:
        trained.set()  # steps 4..8 are queued behind step 3's write, which fails now
    with pytest.raises(SaveFailed):
        rec.close()
    assert [e["step"] for e in read_metadata(tmp_path)["checkpoints"]] == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("delta_*")) == [
        "delta_000001.mckp",
        "delta_000002.mckp",
    ]
    got = reconstruct_weights_at_step(base, tmp_path, 2)
    assert all(bits_equal(got[k], snaps[2][k]) for k in snaps[2])
