"""Issue 8.6: two writers on one run (two managers, two stores, two threads, one folder): no
version is overwritten, no alias update is lost.
"""

from __future__ import annotations

import threading
from pathlib import Path

from mithril_async import CheckpointManager
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

SAVES = scale(6, 40)  # per writer


def test_two_writers_interleaved(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "runs", delta=False, keep_last=10_000)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    versions: dict[int, list[str]] = {0: [], 1: []}

    def writer(w: int) -> None:
        model, counter = Net(), Counter()
        try:
            with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
                barrier.wait(120)  # a safety net: both managers start, however slowly
                for i in range(SAVES):
                    step = 2 * i + 1 + w  # writer 0: odd steps, writer 1: even steps
                    set_step(model, counter, step)
                    res = m.save_nowait(step, metrics={"loss": metric(step)}).result()
                    versions[w].append(str(res.version_id))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    # every save got its own version number: nothing was written twice
    assert len(set(versions[0]) | set(versions[1])) == 2 * SAVES
    model, counter = Net(), Counter()
    with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
        steps = m.all_steps()
        assert steps == list(range(1, 2 * SAVES + 1))
        for s in steps:  # each version holds exactly its own writer's state
            assert m.restore_sync(s) == s and matches_step(model, counter, s)
        # no lost alias update: latest is the highest step, best the lowest loss
        assert m.latest_step() == 2 * SAVES
        assert metric(m.best_step() or 0) == min(metric(s) for s in steps)
    assert leftovers(tmp_path / "runs" / "run1") == ([], [])
