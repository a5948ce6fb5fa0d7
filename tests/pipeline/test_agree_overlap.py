"""The version number is agreed while the codec already encodes (blob keys wait for it).

A coordinator whose agreement only finishes once an encode has started proves the overlap
(serialised, the save would wait the whole timeout); a failing agreement must still fail the
save with nothing written and the previous version intact.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, TensorDict, parse_config
from mithril_async.errors import DistributedError, SaveFailed
from mithril_async.save import chunks
from mithril_async.save.coordinator import LocalCoordinator
from tests.faults._common import leftovers


class GatedCoordinator(LocalCoordinator):
    """Agrees only after ``encoding`` is set (or a 60 s safety net); then claims or fails."""

    def __init__(self, encoding: threading.Event, fail: bool = False) -> None:
        self.encoding, self.fail, self.waited_out = encoding, fail, False

    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        self.waited_out = not await asyncio.to_thread(self.encoding.wait, 60)
        if self.fail:
            raise DistributedError("rank 0 could not claim a version: injected")
        return await claim()


def _setup(tmp_path: Path, monkeypatch: Any) -> tuple[Any, threading.Event, TensorDict]:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n'
                       "[checkpointing.compression]\nthreads = 2\nchunk_mib = 1\n"
                       "auto_chunk = false\n")
    encoding = threading.Event()
    real = chunks.encode_chunk

    def encode(*a: Any, **kw: Any) -> Any:
        encoding.set()
        return real(*a, **kw)

    monkeypatch.setattr(chunks, "encode_chunk", encode)
    g = torch.Generator().manual_seed(3)
    live = TensorDict({"w": torch.randn(3 << 18, generator=g), "b": torch.randn(77, generator=g)})
    return cfg, encoding, live


def test_encoding_starts_before_the_version_number_is_agreed(tmp_path: Path,
                                                             monkeypatch: Any) -> None:
    cfg, encoding, live = _setup(tmp_path, monkeypatch)
    coord = GatedCoordinator(encoding)
    want = {k: v.clone() for k, v in live.tensors.items()}
    with CheckpointManager(cfg, {"model": live}, coordinator=coord) as m:
        res = m.save_nowait(1).result()
        assert res.status == "committed" and res.version_id == "v000001"
        assert not coord.waited_out  # the agreement saw an encode running
        for t in live.tensors.values():
            t.zero_()
        m.restore_sync(1)
    assert all(torch.equal(live.tensors[k], v) for k, v in want.items())
    assert leftovers(tmp_path / "runs" / "r") == ([], [])


def test_a_failed_agreement_fails_the_save_and_writes_nothing(tmp_path: Path,
                                                              monkeypatch: Any) -> None:
    cfg, encoding, live = _setup(tmp_path, monkeypatch)
    with CheckpointManager(cfg, {"model": live}) as m:  # version 1 the normal way
        assert m.save_nowait(1).result().status == "committed"
    want = {k: v.clone() for k, v in live.tensors.items()}
    encoding.clear()
    coord = GatedCoordinator(encoding, fail=True)
    with CheckpointManager(cfg, {"model": live}, coordinator=coord) as m:
        with pytest.raises((DistributedError, SaveFailed)) as info:
            m.save_nowait(2).result()
        err = info.value if isinstance(info.value, DistributedError) else info.value.__cause__
        assert isinstance(err, DistributedError) and "injected" in str(err)
        assert not coord.waited_out  # it failed while the codec was already running
        assert m.latest_step() == 1
        run = tmp_path / "runs" / "r"
        assert leftovers(run) == ([], [])  # no blob of the failed save reached the disk
        assert sorted(p.name for p in (run / "versions").iterdir()) == ["v000001"]
        for t in live.tensors.values():
            t.add_(1.0)
        coord.fail = False  # the manager goes on: the error is reported once, then saves commit
        with pytest.raises(SaveFailed, match="injected"):
            m.save_nowait(3)
        assert m.save_nowait(3).result().status == "committed"
        m.restore_sync(1)
    assert all(torch.equal(live.tensors[k], v) for k, v in want.items())
