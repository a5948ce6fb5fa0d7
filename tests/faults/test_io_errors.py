"""Issue 8.3: ENOSPC and EIO on the N-th I/O call of a save, N = 1, 2, ... until the save
succeeds: a typed error naming the key, no temp data left, the previous version intact, and
the next save (fault cleared) succeeds - on the real file system (``LocalStore`` over an
``os`` shim) and at the Store level (every Store call of the save, reads included).
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager, SaveFailed, StorageError
from mithril_async.retention import from_config, plan_deletions
from mithril_async.storage import local as local_mod
from mithril_async.storage.memory import MemoryStore
from tests.faults._common import (
    LONG,
    Counter,
    Net,
    leftovers,
    make_config,
    matches_step,
    metric,
    set_step,
)
from tests.faults._faultos import FaultOS


def _save(m: CheckpointManager, model: Net, counter: Counter, step: int) -> BaseException | None:
    set_step(model, counter, step)
    try:
        m.save_nowait(step, metrics={"loss": metric(step)}).result()
    except Exception as err:
        with pytest.raises(SaveFailed):  # reported once more, typed, by the next call
            m.check_for_errors()
        return err
    return None


def _fault_loop(m: CheckpointManager, model: Net, counter: Counter, arm: Any,
                fired: Any, check_disk: Any, code: int, reader: Any) -> tuple[int, int]:
    """Fail call N of a save for N = 1, 2, ...; return (faults injected, committed anyway).

    ``reader()`` opens a second manager on the same store for the checks, so the writer's
    delta chain is not reset by restores and later saves really are deltas.
    """

    def check(expect: tuple[int, ...], also: int | None = None) -> None:
        r_model, r_counter = Net(), Counter()
        with reader(r_model, r_counter) as r:
            latest = r.restore_sync("latest")
            assert latest in expect and matches_step(r_model, r_counter, latest), latest
            for s in [also] if also is not None else []:
                assert r.restore_sync(s) == s and matches_step(r_model, r_counter, s)

    good = 1
    set_step(model, counter, good)
    m.save_nowait(good, metrics={"loss": metric(good)}).result()
    step, n, faults, committed_anyway, swallowed = good, 0, 0, 0, 0
    while True:
        n += 1
        step += 1
        arm(n, code)
        err = _save(m, model, counter, step)
        where = fired()
        arm(None, code)
        if where is None:  # the save needed fewer than n calls: done
            assert err is None
            break
        faults += 1
        if err is None:  # only retention, after the commit, may fail quietly (it is logged)
            assert step in m.all_steps() and m.latest_step() == step, f"call {n}: {where}"
            check((step,))
            swallowed += 1
            # the next save retries retention: without it, versions would pile up and each
            # save's calls before retention grow with them (one lookup per version folder)
            step += 1
            assert _save(m, model, counter, step) is None, f"save after fault {n} failed"
            left = m._bg(plan_deletions(m.catalog, from_config(m.cfg)))
            assert left == [], f"retention not retried: {[v.step for v in left]}"
            good = step
            continue
        assert isinstance(err, StorageError) and err.errno == code, repr(err)
        assert "runs/run1" in str(err), f"error names no key: {err}"
        check_disk()
        if step in m.all_steps():  # failed after its manifest: committed and complete
            committed_anyway += 1
            check((good, step), also=step)
        else:
            check((good,))
        step += 1
        assert _save(m, model, counter, step) is None, f"save after fault {n} failed"
        good = step
        check((good,))
    print(f"  {faults} faults, {committed_anyway} after the manifest, {swallowed} in retention")
    return faults, committed_anyway


CODES = [errno.ENOSPC, errno.EIO]


@pytest.mark.parametrize("code", CODES, ids=["ENOSPC", "EIO"])
def test_disk_error_on_every_call_of_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            code: int) -> None:
    fos = FaultOS()
    monkeypatch.setattr(local_mod, "os", fos)
    root = tmp_path / "runs" / "run1"

    def check_disk() -> None:
        assert leftovers(root) == ([], []), "a failed save left data behind"

    model, counter = Net(), Counter()
    cfg = make_config(tmp_path / "runs", keep_last=2, delta=code == errno.EIO)

    def reader(r_model: Net, r_counter: Counter) -> CheckpointManager:
        return CheckpointManager(cfg, {"model": r_model, "data": r_counter})

    with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
        faults, _ = _fault_loop(m, model, counter, fos.arm, lambda: fos.fired, check_disk, code,
                                reader)
        steps = m.all_steps()
    with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
        assert leftovers(root) == ([], [])  # what a failed retention left, the start cleaned
        assert m.all_steps() == steps
        for s in steps:
            assert m.restore_sync(s) == s and matches_step(model, counter, s)
    assert faults >= 30  # every open/write/fsync/rename/link/mkdir of a save was hit once
    print(f"disk {errno.errorcode[code]}: {faults} faults")


class CountingStore(MemoryStore):
    """A MemoryStore whose N-th call (any operation, reads too) raises OSError(code)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.fail_at, self.code, self.fired = 0, None, errno.EIO, None

    def arm(self, n: int | None, code: int) -> None:
        self.calls, self.fail_at, self.code, self.fired = 0, n, code, None

    async def _step(self, op: str, key: str) -> None:
        await asyncio.sleep(0)
        self.calls += 1
        if self.calls == self.fail_at:
            self.fired = f"{op} {key}"
            raise StorageError(self.code, f"{op} {key!r}: injected {errno.errorcode[self.code]}",
                               key)


def _reader(store: MemoryStore, cfg: Any) -> Any:
    def open_reader(r_model: Net, r_counter: Counter) -> CheckpointManager:
        return CheckpointManager(cfg, {"model": r_model, "data": r_counter}, store=store,
                                 runs_prefix="runs")
    return open_reader


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_store_error_on_every_call_of_a_save(delta: bool) -> None:
    store = CountingStore()

    def check_disk() -> None:
        keys = asyncio.run(store.list("runs/run1/versions"))
        committed = {k.rsplit("/", 2)[-2] for k in keys if k.endswith("manifest.json")}
        stray = [k for k in keys if k.rsplit("/", 2)[-2] not in committed]
        assert stray == [] and not store._incomplete, (stray, store._incomplete)

    model, counter = Net(), Counter()
    cfg = make_config(Path("/nonexistent/runs"), keep_last=2, delta=delta)
    with CheckpointManager(cfg, {"model": model, "data": counter}, store=store,
                           runs_prefix="runs") as m:
        faults, anyway = _fault_loop(m, model, counter, store.arm, lambda: store.fired,
                                     check_disk, errno.EIO, _reader(store, cfg))
        if delta:  # not vacuous: the saves after faults were deltas against committed bases
            assert any(v.model.base is not None for v in m._bg(m.catalog.versions()))
    assert faults >= 15 and anyway >= 1
    print(f"store EIO ({'delta' if delta else 'full'}): {faults} faults, {anyway} after commit")


if LONG:  # both error codes at the Store level too
    @pytest.mark.parametrize("code", CODES, ids=["ENOSPC", "EIO"])
    def test_store_error_codes_long(code: int) -> None:
        store = CountingStore()
        model, counter = Net(), Counter()
        cfg = make_config(Path("/nonexistent/runs"), keep_last=1, delta=True)
        with CheckpointManager(cfg, {"model": model, "data": counter}, store=store,
                               runs_prefix="runs") as m:
            faults, _ = _fault_loop(m, model, counter, store.arm, lambda: store.fired,
                                    lambda: None, code, _reader(store, cfg))
        assert faults >= 15
