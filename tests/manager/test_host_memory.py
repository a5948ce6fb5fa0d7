"""``[checkpointing.pipeline] host_memory_mib``: a hard cap on the host memory a save holds.

A state bigger than the budget streams through the slot ring (``SaveResult.streamed``), in
both snapshot modes, and restores exactly; the pipeline's own account never passes the budget
and agrees with the process's resident set; what cannot be split fails before anything is
published; a budget that fits the staged path leaves it as it was."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import (
    CheckpointManager,
    Config,
    ConfigError,
    SaveFailed,
    TensorDict,
    parse_config,
)
from mithril_async.errors import HostMemoryExceeded, SnapshotTorn
from mithril_async.memory.budget import HostBudget
from mithril_async.save.overlap import StreamCopy
from mithril_async.save.stream_snapshot import StreamSnapshot

MiB = 1 << 20
#: streamed saves encoded in the training process, and by a checkpoint worker from the ring
#: slots the trainer copies each chunk into
PROCESSES = pytest.mark.parametrize("process", ["inline", "worker"])
SCRIPT = Path(__file__).with_name("_budget_rss_script.py")


def _cfg(tmp_path: Path, budget: int | None, extra: str = "", pipe: str = "",
         process: str = "inline") -> Config:
    """``process = "worker"``: the checkpoint worker encodes what the trainer copies out."""
    text = (f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n'
            "[checkpointing.compression]\nthreads = 2\n" + extra
            + f'[checkpointing.pipeline]\nprocess = "{process}"\n' + pipe
            + ("" if budget is None else f"host_memory_mib = {budget}\n"))
    return parse_config(text)


def _state(mib: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(mib):  # 1 MiB each: a bf16 and an fp32 half, plus a tiny norm
        out[f"l{i}.w"] = torch.randn(1 << 18, generator=g).to(torch.bfloat16)
        out[f"l{i}.m"] = torch.randn(1 << 17, generator=g)
        out[f"l{i}.b"] = torch.randn(7, generator=g)
    return TensorDict(out)


def _peak_recorder(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every value the account's ``held`` ever takes (to check it never passes the limit)."""
    seen: list[int] = []
    real = HostBudget._add

    def add(self: HostBudget, n: int) -> None:
        real(self, n)
        seen.append(self.held)

    monkeypatch.setattr(HostBudget, "_add", add)
    return seen


def test_budget_below_the_minimum_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"host_memory_mib = 20 is below the minimum of 28 MiB"):
        _cfg(tmp_path, 20)
    with pytest.raises(ConfigError, match=r"minimum of 10 MiB.*chunk_mib = 1"):
        _cfg(tmp_path, 9, extra="chunk_mib = 1\n")
    assert _cfg(tmp_path, 28).checkpointing.pipeline.host_memory_mib == 28


@PROCESSES
def test_a_state_bigger_than_the_budget_streams_and_restores_exactly(
        tmp_path: Path, process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _peak_recorder(monkeypatch)
    live = _state(48)  # 48 MiB through a 32 MiB budget
    want = {k: v.clone() for k, v in live.tensors.items()}
    with CheckpointManager(_cfg(tmp_path, 32, process=process), {"model": live}) as m:
        assert m.process == process
        res = m.save_nowait(1).result()
        assert res.streamed and res.status == "committed"
        assert 0 < res.host_peak_bytes <= 32 * MiB
        assert max(seen) <= 32 * MiB
        res2 = m.save_nowait(2).result()  # the ring is reused: no new allocation
        assert res2.streamed and res2.host_peak_bytes <= 32 * MiB
        for t in live.tensors.values():
            t.zero_()
        assert m.restore_sync(1) == 1
    assert all(torch.equal(live.tensors[k], want[k]) for k in want)


def test_streamed_blob_is_byte_identical_to_the_staged_one(tmp_path: Path) -> None:
    """One codec thread: chunks complete in order, so the two paths' bytes can be compared."""
    blobs = []
    for budget, sub in ((None, "staged"), (32, "streamed")):
        cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/{sub}"\nrun_id = "r"\n'
                           "[checkpointing.compression]\nthreads = 1\n"
                           + ("" if budget is None else
                              f"[checkpointing.pipeline]\nhost_memory_mib = {budget}\n"))
        with CheckpointManager(cfg, {"model": _state(40)}) as m:
            assert m.save_nowait(3).result().streamed is (budget is not None)
        blobs.append((tmp_path / sub / "r/versions/v000001/model.mckp").read_bytes())
    assert blobs[0] == blobs[1]


@PROCESSES
def test_uncompressed_state_streams_as_safetensors(tmp_path: Path, process: str) -> None:
    import safetensors.torch

    live = _state(40)
    cfg = _cfg(tmp_path, 32, extra="enabled = false\n", process=process)
    with CheckpointManager(cfg, {"model": live}) as m:
        assert m.process == process
        res = m.save_nowait(1).result()
        assert res.streamed and res.host_peak_bytes <= 32 * MiB
    loaded = safetensors.torch.load_file(tmp_path / "runs/r/versions/v000001/model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in live.tensors.items())


def test_budget_that_fits_keeps_the_staged_path(tmp_path: Path) -> None:
    live = _state(8)
    with CheckpointManager(_cfg(tmp_path, 512), {"model": live}) as m:
        res = m.save_nowait(1).result()
    assert not res.streamed and res.host_peak_bytes <= 512 * MiB
    staged = sum(t.numel() * t.element_size() for t in live.tensors.values())
    assert res.host_peak_bytes > staged  # the staging copy is in the account
    with CheckpointManager(_cfg(tmp_path / "u", None), {"model": _state(8)}) as m:
        unl = m.save_nowait(1).result()
    # the same path and the same account (up to a header's few bytes)
    assert not unl.streamed and abs(unl.host_peak_bytes - res.host_peak_bytes) < 64 << 10


@PROCESSES
def test_delta_chains_under_a_budget_fall_back_to_keyframes(tmp_path: Path, process: str
                                                            ) -> None:
    live = _state(24)
    # 2 x 24 MiB of bases would not fit
    cfg = _cfg(tmp_path, 40, extra="delta = true\n", process=process)
    with CheckpointManager(cfg, {"model": live}) as m:
        for step in (1, 2):
            live.tensors["l0.b"].add_(1)
            res = m.save_nowait(step).result()
            assert res.streamed and res.host_peak_bytes <= 40 * MiB
        want = {k: v.clone() for k, v in live.tensors.items()}
        man = json.loads((tmp_path / "runs/r/versions/v000002/manifest.json").read_text())
        assert man["model"].get("base") is None  # a keyframe, no base held or read
        live.tensors["l3.w"].zero_()
        m.restore_sync(2)
    assert all(torch.equal(live.tensors[k], want[k]) for k in want)


class _Big:
    def __init__(self) -> None:
        self.w = torch.randn(1 << 20)
        self.notes = ["x" * 1000] * 40_000  # ~40 MiB of JSON: cannot be split

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "meta": {"notes": self.notes, "lr": 0.1}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.w = sd["w"]


def test_unsplittable_value_over_the_budget_fails_and_publishes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(_cfg(tmp_path, 32), {"model": _Big()}) as m:
        with pytest.raises(HostMemoryExceeded, match=r"'model/meta/notes'.*cannot be split"):
            m.save_nowait(1)
        assert m.history == []
    assert not (tmp_path / "runs/r/versions").exists() or not list(
        (tmp_path / "runs/r/versions").glob("*/manifest.json"))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
        self.calls: torch.Tensor
        self.register_buffer("calls", torch.zeros(1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)  # forward changes a buffer (like batch-norm statistics)
        out: torch.Tensor = self.layers(x)
        return out


def _train(model: _Net, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    opt.zero_grad()


@PROCESSES
def test_overlapped_under_budget_step_waits_for_what_is_not_copied_out(
        tmp_path: Path, process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    gate = threading.Event()
    later_fetches: list[int] = []
    real = StreamSnapshot.fetch

    def gated(self: StreamSnapshot, lease: Any, t: Any, off: int, n: int) -> Any:
        if t.later:  # the optimizer's tensors wait for the test to open the gate
            assert gate.wait(60)
            later_fetches.append(n)
        return real(self, lease, t, off, n)

    monkeypatch.setattr(StreamSnapshot, "fetch", gated)
    real_before_step = StreamCopy.before_step

    def before_step(self: StreamCopy) -> float:
        """Deterministic, whatever the machine's speed (as test_overlap does): the gate opens
        only once the step hook has seen the optimizer's copy-out unfinished, so the step can
        only go on by waiting for it."""
        fut = self.stream.all_done

        def done_then_open() -> bool:
            finished = concurrent.futures.Future.done(fut)
            gate.set()
            return finished

        setattr(fut, "done", done_then_open)  # noqa: B010 (an instance attribute on purpose)
        try:
            return real_before_step(self)
        finally:
            delattr(fut, "done")

    monkeypatch.setattr(StreamCopy, "before_step", before_step)
    # state: ~19 MiB x 2 items
    cfg = _cfg(tmp_path, 32, pipe='snapshot = "overlapped"\n', process=process)
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        expected = {"model": copy.deepcopy(model.state_dict()),
                    "optimizer": copy.deepcopy(opt.state_dict())}
        handle = m.save_nowait(1)  # returns: the buffer is copied out, the rest is gated
        pending = m.saves.guard.pending if m.saves.guard is not None else None
        assert isinstance(pending, StreamCopy)
        job_stream = pending.stream
        assert job_stream.now_done.done()
        assert not job_stream.all_done.done() and later_fetches == []
        stepped = threading.Event()

        def step() -> None:
            _train(model, opt)  # forward + backward run now; step() waits at its hook
            stepped.set()

        th = threading.Thread(target=step)
        th.start()  # its step hook opens the gate
        th.join(60)
        assert stepped.is_set() and job_stream.all_done.done()
        res = handle.result()
        assert res.streamed and res.status == "committed" and sum(later_fetches) > 0
        assert res.step_wait_s > 0 and res.host_peak_bytes <= 32 * MiB
        live_after = copy.deepcopy(model.state_dict())
        m.restore_sync(1)
        sd = model.state_dict()
        # the version holds the state of its save(), not the stepped one
        assert all(torch.equal(sd[k], expected["model"][k]) for k in sd if k != "calls")
        assert not torch.equal(sd["layers.0.weight"], live_after["layers.0.weight"])
        st = opt.state_dict()["state"][0]
        assert torch.equal(st["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])


@PROCESSES
def test_overlapped_under_budget_torn_change_fails_the_save_only(tmp_path: Path, process: str
                                                                 ) -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    cfg = _cfg(tmp_path, 32, pipe='snapshot = "overlapped"\n', process=process)
    gate = threading.Event()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        m.save_nowait(1).result()
        good = copy.deepcopy(model.state_dict())
        real = StreamSnapshot.fetch

        def gated(self: StreamSnapshot, lease: Any, t: Any, off: int, n: int) -> Any:
            if t.later:
                assert gate.wait(60)
            return real(self, lease, t, off, n)

        StreamSnapshot.fetch = gated  # type: ignore[method-assign]
        try:
            handle = m.save_nowait(2)
            with torch.no_grad():
                model.layers[3].weight.add_(1.0)  # type: ignore[operator]  # not through a hooked step(): torn
            gate.set()
            with pytest.raises(SaveFailed) as info:
                m.wait()
            assert isinstance(info.value.__cause__, SnapshotTorn)
            assert "model/layers.3.weight" in str(info.value)
        finally:
            StreamSnapshot.fetch = real  # type: ignore[method-assign]
        assert handle.result_obj.status == "failed"
        assert [r.status for r in m.history] == ["committed", "failed"]
        assert not (tmp_path / "runs/r/versions/v000002/manifest.json").exists()
        m.restore_sync("latest")
    assert all(torch.equal(model.state_dict()[k], good[k]) for k in good if k != "calls")


def test_one_gib_state_under_128_mib_budget_peak_rss(tmp_path: Path) -> None:
    """The regression test of the bound, in a fresh process: a 1 GiB state saved with
    host_memory_mib = 128; its peak resident set above the baseline stays under budget +
    64 MiB, the pipeline's own account stays under the budget and agrees with it."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "runs"), "1024", "128",
                          "blocking"], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    slack = 64 * MiB
    assert got["streamed"] and got["bytes_in"] >= 1 << 30
    assert got["host_peak"] <= got["budget"]
    assert got["rss_extra"] <= got["budget"] + slack, got
    assert abs(got["rss_extra"] - got["host_peak"]) <= slack, got

