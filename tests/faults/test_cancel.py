"""Issue 8.4: cancelling a save (task cancel, timeout) at any await point: writers aborted,
nothing half-published, the manager stays usable and the next save commits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore
from tests.faults._common import (
    Counter,
    Net,
    leftovers,
    make_config,
    matches_step,
    metric,
    scale,
    set_step,
)


class BlockingStore(MemoryStore):
    """The N-th store call (any operation) hangs until it is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.block_at, self.blocked_in = 0, None, None
        self.blocked = threading.Event()

    def arm(self, n: int | None) -> None:
        self.calls, self.block_at, self.blocked_in = 0, n, None
        self.blocked.clear()

    async def _step(self, op: str, key: str) -> None:
        await asyncio.sleep(0)
        self.calls += 1
        if self.calls == self.block_at:
            self.blocked_in = f"{op} {key}"
            self.blocked.set()
            await asyncio.Event().wait()  # forever, until cancelled


def _stray(store: MemoryStore) -> list[str]:
    keys = asyncio.run(store.list("runs/run1/versions"))
    committed = {k.rsplit("/", 2)[-2] for k in keys if k.endswith("manifest.json")}
    return [k for k in keys if k.rsplit("/", 2)[-2] not in committed]


def test_cancel_at_every_store_call_of_a_save() -> None:
    store = BlockingStore()
    cfg = make_config(Path("/nonexistent/runs"), keep_last=2, delta=True)
    model, counter = Net(), Counter()
    cancelled = committed_anyway = 0

    def check(expect: tuple[int, ...], also: int | None = None) -> None:
        r_model, r_counter = Net(), Counter()
        with CheckpointManager(cfg, {"model": r_model, "data": r_counter}, store=store,
                               runs_prefix="runs") as r:
            latest = r.restore_sync("latest")
            assert latest in expect and matches_step(r_model, r_counter, latest)
            if also is not None:
                assert r.restore_sync(also) == also and matches_step(r_model, r_counter, also)

    with CheckpointManager(cfg, {"model": model, "data": counter}, store=store,
                           runs_prefix="runs") as m:
        good = step = 1
        set_step(model, counter, step)
        m.save_nowait(step, metrics={"loss": metric(step)}).result()
        n = 0
        while True:
            n += 1
            step += 1
            store.arm(n)
            set_step(model, counter, step)
            handle = m.save_nowait(step, metrics={"loss": metric(step)})
            assert handle.future is not None
            concurrent.futures.wait([handle.future, _waiter(store.blocked)],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            if handle.future.done():  # finished before reaching call n: every point covered
                store.arm(None)
                assert handle.result().status == "committed"
                break
            where = store.blocked_in
            assert handle.future.cancel(), f"could not cancel at call {n} ({where})"
            store.arm(None)
            cancelled += 1
            assert m._bg(_idle()) is None  # the loop is responsive
            settle(m)  # the task's shielded cleanup may still be finishing: wait for it
            assert not store._incomplete, f"writer left open after cancel at {where}"
            assert _stray(store) == [], f"cancel at {where} left {_stray(store)}"
            m.check_for_errors()  # a cancelled save is not an error to re-raise
            if step in m.all_steps():  # cancelled after its manifest: complete
                committed_anyway += 1
                check((good, step), also=step)
            else:
                check((good,))
            step += 1
            set_step(model, counter, step)
            assert m.save_nowait(step, metrics={"loss": metric(step)}).result().status == \
                "committed", f"save after a cancel at {where}"
            good = step
            check((good,))
    assert cancelled >= 15 and committed_anyway >= 1, (cancelled, committed_anyway)
    print(f"cancel: {cancelled} cancellations, {committed_anyway} after the manifest")


def _waiter(ev: threading.Event) -> concurrent.futures.Future[None]:
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    threading.Thread(target=lambda: (ev.wait(120), fut.set_result(None)), daemon=True).start()
    return fut


async def _idle() -> None:
    return None


async def _others_done(limit_s: float) -> None:
    """Wait until every other task of this loop has finished (a cancelled save's shielded
    cleanup, the writers it aborts); ``limit_s`` is a safety net, not a timing."""
    loop = asyncio.get_running_loop()
    me, deadline = asyncio.current_task(), loop.time() + limit_s
    while others := {t for t in asyncio.all_tasks() if t is not me}:
        left = deadline - loop.time()
        assert left > 0, f"still running after {limit_s:g} s: {others}"
        await asyncio.wait(others, timeout=left)


def settle(m: CheckpointManager) -> None:
    """Block until the manager's loop has nothing left running (events, not a sleep)."""
    m.loop.run(_others_done(120))


class _ManifestGate:
    """While ``closed``, every manifest publication on a LocalStore waits (cancellably), so a
    save in flight cannot commit: a timeout or a close then surely lands mid-save."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.closed = False
        real = LocalStore.put_if_absent
        gate = self

        async def put_if_absent(store: LocalStore, key: str, data: Any) -> None:
            while gate.closed and key.endswith("manifest.json"):
                await asyncio.sleep(0.001)
            await real(store, key, data)

        monkeypatch.setattr(LocalStore, "put_if_absent", put_if_absent)


def test_timeout_and_close_mid_save_on_disk(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A real timeout (asyncio.wait_for) and close(wait=False) while blobs stream to disk.

    Round 0 holds the manifests back, so its timeout and its close surely land mid-save
    (the counts below cannot depend on the machine's speed); later rounds let the save race
    the timeout and the close, to land at other points."""
    gate = _ManifestGate(monkeypatch)
    cfg = make_config(tmp_path / "runs", keep_last=3, delta=False,
                      extra="")
    root = tmp_path / "runs" / "run1"
    model, counter = Net(), Counter()
    timeouts = abandoned = 0
    for round_ in range(scale(3, 20)):
        with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
            base = max(m.all_steps(), default=0)
            set_step(model, counter, base + 1)
            m.save_nowait(base + 1, metrics={"loss": metric(base + 1)}).result()

            async def timed(step: int, timeout: float) -> Any:
                set_step(model, counter, step)
                handle = await m.save(step, metrics={"loss": metric(step)})
                assert handle.future is not None
                try:
                    await asyncio.wait_for(asyncio.wrap_future(handle.future), timeout)
                except TimeoutError:
                    return "timeout"
                return "done"

            gate.closed = round_ == 0
            outcome = asyncio.run(timed(base + 2, 0.0005 * round_))
            gate.closed = False
            timeouts += outcome == "timeout"
            m.check_for_errors()
            steps = m.all_steps()
            assert base + 1 in steps
            settle(m)  # the cancelled task's cleanup may still run
            assert leftovers(root) == ([], [])
            set_step(model, counter, base + 3)
            m.save_nowait(base + 3, metrics={"loss": metric(base + 3)}).result()
            # close while the next save is in flight: abandoned, never half-published
            set_step(model, counter, base + 4)
            gate.closed = round_ == 0
            m.save_nowait(base + 4, metrics={"loss": metric(base + 4)})
            time.sleep(0.002 * round_)  # varies where the close lands; no result depends on it
            m.close(wait=False)
            gate.closed = False
        # close(wait=False) lets the abandoned save's cleanup finish: nothing half-written
        assert leftovers(root) == ([], [])
        r_model, r_counter = Net(), Counter()
        with CheckpointManager(cfg, {"model": r_model, "data": r_counter}) as r:
            latest = r.restore_sync("latest")
            assert latest >= base + 3 and matches_step(r_model, r_counter, latest)
            abandoned += base + 4 not in r.all_steps()
            for s in r.all_steps():
                assert r.restore_sync(s) == s and matches_step(r_model, r_counter, s)
    assert timeouts >= 1 and abandoned >= 1, (timeouts, abandoned)
    print(f"timeouts: {timeouts}, closes that abandoned a save: {abandoned}")
