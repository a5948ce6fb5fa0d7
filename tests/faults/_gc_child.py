"""A cleaner held between its plan and its removals: ``mithril gc`` or a manager's start.

    python -m tests.faults._gc_child gc RUNS     # mithril gc RUNS --json, held before apply
    python -m tests.faults._gc_child start RUNS  # a CheckpointManager start on RUNS/run1,
                                                 # held once its clean-up has listed

Once the plan is made the child prints one line, ``planned <json>`` (gc: each planned item's
kind and folder; start: the abandoned version numbers), and then waits for a line on stdin:
the gate the test opens after another process has used the run. Then it carries on, and gc
prints its JSON report; a start prints ``removed <json>`` (the folders it removed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mithril_async import CheckpointManager
from mithril_async.catalog import RunCatalog
from mithril_async.cli import main as mithril
from mithril_async.commands import gc

from ._common import Counter, Net, make_config


def _wait_at_gate(planned: object) -> None:
    print("planned", json.dumps(planned), flush=True)
    if not sys.stdin.readline():
        raise SystemExit("the gate closed without opening")


def hold_gc(runs: str) -> int:
    apply_run = gc.apply_run

    async def held(target: Any, run_id: str, plan: list[dict[str, Any]], args: Any,
                   *rest: Any) -> None:
        _wait_at_gate([[i["kind"], i["what"]] for i in plan])
        await apply_run(target, run_id, plan, args, *rest)

    gc.apply_run = held
    return mithril(["gc", runs, "--json"])


def hold_start(runs: str) -> int:
    unfinished = RunCatalog.unfinished
    removed: list[str] = []
    clean = RunCatalog.clean_unfinished

    async def held(self: RunCatalog, **kw: Any) -> Any:
        stale, live = await unfinished(self, **kw)
        _wait_at_gate(sorted(stale))
        return stale, live

    async def recorded(self: RunCatalog, **kw: Any) -> list[str]:
        out = await clean(self, **kw)
        removed.extend(out)
        return out

    RunCatalog.unfinished = held  # type: ignore[method-assign]
    RunCatalog.clean_unfinished = recorded  # type: ignore[method-assign]
    with CheckpointManager(make_config(Path(runs), delta=False),
                           {"model": Net(), "data": Counter()}):
        pass  # entering `with` runs the start-up clean-up
    print("removed", json.dumps(removed), flush=True)
    return 0


if __name__ == "__main__":
    mode, runs_dir = sys.argv[1], sys.argv[2]
    sys.exit(hold_gc(runs_dir) if mode == "gc" else hold_start(runs_dir))
