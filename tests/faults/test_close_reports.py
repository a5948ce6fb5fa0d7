"""Issue 19, item 5: a save's failure is raised by ``close()`` / ``with`` when nobody has seen
it yet (an injected ENOSPC used to appear only in the log), never twice, and never in place of
an exception already propagating out of ``with``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
from pathlib import Path

import pytest

from mithril_async import CheckpointManager, SaveFailed, StorageError
from mithril_async.storage.memory import MemoryStore
from tests.faults._common import Counter, Net, make_config, metric, set_step

BLOB = "runs/run1/versions/v000002/model.mckp"


def _enospc() -> StorageError:
    return StorageError(errno.ENOSPC, f"write {BLOB!r}: injected ENOSPC", BLOB)


def _manager(store: MemoryStore) -> tuple[CheckpointManager, Net, Counter]:
    model, counter = Net(), Counter()
    m = CheckpointManager(make_config(Path("/nonexistent/runs"), delta=False),
                          {"model": model, "data": counter}, store=store, runs_prefix="runs")
    return m, model, counter


def _fails(m: CheckpointManager, store: MemoryStore, model: Net, counter: Counter,
           step: int) -> concurrent.futures.Future[object]:
    """Start a save whose model blob hits ENOSPC at its commit; return its future."""
    store.inject_fault("commit", _enospc())
    set_step(model, counter, step)
    fut = m.save_nowait(step, metrics={"loss": metric(step)}).future
    assert fut is not None
    return fut  # type: ignore[return-value]


def test_close_raises_an_unseen_save_failure_once() -> None:
    """Raised once; not after ``check_for_errors()`` or ``handle.result()`` reported it."""
    store = MemoryStore()
    m, model, counter = _manager(store)
    set_step(model, counter, 1)
    m.save_nowait(1, metrics={"loss": metric(1)}).result()
    _fails(m, store, model, counter, 2)
    with pytest.raises(SaveFailed) as info:
        m.close()  # waits for the save in flight, then reports its failure
    cause = info.value.__cause__
    assert isinstance(cause, StorageError) and cause.errno == errno.ENOSPC
    assert BLOB in str(info.value)
    m.close()  # reported once: closing again is quiet
    m2, model, counter = _manager(store)
    concurrent.futures.wait([_fails(m2, store, model, counter, 2)])
    with pytest.raises(SaveFailed):
        m2.check_for_errors()
    m2.close()  # already reported: not raised again
    m3, model, counter = _manager(store)
    store.inject_fault("commit", _enospc())
    with pytest.raises(StorageError):
        m3.save_nowait(2, metrics={"loss": metric(2)}).result()  # the caller saw it
    m3.close()


def test_with_raises_the_failure_unless_another_exception_propagates(
        caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    m, model, counter = _manager(store)
    with pytest.raises(SaveFailed), m:
        _fails(m, store, model, counter, 2)
    m2, model, counter = _manager(store)
    with caplog.at_level(logging.ERROR, "mithril_async"), pytest.raises(KeyError), m2:
        concurrent.futures.wait([_fails(m2, store, model, counter, 3)])
        raise KeyError("the training loop's own error")
    assert "a background save failed (not raised" in caplog.text and "ENOSPC" in caplog.text
