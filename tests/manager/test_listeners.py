"""Save results reach listeners (``on_result``, ``add_listener``): committed, failed and
skipped results, on a thread that is never the caller's, a raising listener logged and the
save standing, ``on_save`` still inline."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from mithril_async import CheckpointManager, Config, SaveResult
from mithril_async.errors import SaveFailed, StorageError
from mithril_async.storage.memory import MemoryStore
from tests.manager.conftest import make_state

ConfigFactory = Callable[..., Config]


class Heard:
    """A listener recording each result with the thread it ran on."""

    def __init__(self) -> None:
        self.results: list[tuple[int, str, int]] = []

    def __call__(self, res: SaveResult) -> None:
        self.results.append((res.step, res.status, threading.get_ident()))

    @property
    def seen(self) -> list[tuple[int, str]]:
        return [(step, status) for step, status, _ in self.results]


class GatedStore(MemoryStore):
    """Holds every manifest commit until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def put_if_absent(self, key: str, data: Any) -> None:
        if key.endswith("manifest.json"):
            assert await asyncio.to_thread(self.gate.wait, 60), "the test never opened the gate"
        await super().put_if_absent(key, data)


def test_committed_and_skipped_results_reach_listeners_off_the_callers_thread(
        make_config: ConfigFactory) -> None:
    model, _opt, _ = make_state()
    store = GatedStore()
    first, second, removed = Heard(), Heard(), Heard()
    cfg = make_config('[checkpointing.pipeline]\non_busy = "skip"\n')
    with CheckpointManager(cfg, {"model": model}, store=store, on_result=first) as m:
        m.add_listener(second)
        m.add_listener(removed)
        m.remove_listener(removed)
        held = m.save_nowait(1)
        assert m.save_nowait(2).skipped  # the first still waits for its manifest
        store.gate.set()
        assert held.result().status == "committed"
        m.wait()  # returns once every finished save's result was delivered
        assert first.seen == second.seen == [(2, "skipped"), (1, "committed")]
        m.save_nowait(3)
    assert first.seen[-1] == (3, "committed")  # close() delivered it before returning
    assert removed.results == []
    me = threading.get_ident()
    assert all(ident != me for _, _, ident in first.results + second.results)
    with pytest.raises(ValueError, match="not a listener"):
        m.remove_listener(removed)


def test_failed_save_reaches_listeners_and_the_log_at_error_with_its_step(
        make_config: ConfigFactory, caplog: pytest.LogCaptureFixture) -> None:
    model, _opt, _ = make_state()
    store = MemoryStore()
    heard = Heard()
    m = CheckpointManager(make_config(), {"model": model}, store=store, on_result=heard)
    m.save_nowait(1).result()
    store.inject_fault("put", StorageError("injected: disk gone"), times=10)
    with caplog.at_level(logging.ERROR, logger="mithril_async"):
        m.save_nowait(2)
        with pytest.raises(SaveFailed, match="injected"):
            m.wait()
    m.close()
    assert heard.seen == [(1, "committed"), (2, "failed")]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("step 2" in msg and "injected" in msg for msg in errors), errors


def test_a_raising_listener_is_logged_and_the_save_commits(
        make_config: ConfigFactory, caplog: pytest.LogCaptureFixture) -> None:
    model, _opt, _ = make_state()
    after = Heard()
    inline: list[int] = []

    def broken(res: SaveResult) -> None:
        raise RuntimeError(f"listener bug at step {res.step}")

    def on_save(res: SaveResult) -> None:  # the older hook: inline, before result() returns
        inline.append(res.step)
        raise RuntimeError("on_save bug")

    with caplog.at_level(logging.ERROR, logger="mithril_async"), CheckpointManager(
            make_config(), {"model": model}, on_result=broken, on_save=on_save) as m:
        m.add_listener(after)
        res = m.save_nowait(1).result()  # neither callback fails the save
        assert inline == [1]
        m.wait()
        assert res.status == "committed" and m.all_steps() == [1]
    assert after.seen == [(1, "committed")]  # the next listener still ran
    failed = [r for r in caplog.records if "listener" in r.getMessage()]
    assert failed and failed[0].exc_info is not None  # with its traceback
    assert "listener bug at step 1" in str(failed[0].exc_info[1])
    assert any("on_save callback failed" in r.getMessage() and r.exc_info is not None
               for r in caplog.records)
