"""SIGKILL harness, run as ``python -m tests.faults._kill_server RUNS KILLS SEED OUT``.

Importing torch costs seconds on a loaded machine, so this process imports everything once and
then forks: a *saver* child opens a CheckpointManager on the shared runs folder and saves
as fast as it can (the next save waits for the previous one, so the pipeline is always busy:
claim, encode, blob writes, manifest, aliases, run.json, retention) until it is SIGKILLed
a random delay after it committed its first save. A *verifier* child then inspects what the
kill left, starts a manager (which must clean the leftovers), restores every committed version
and checks it bit for bit. The server itself never starts a thread, so forking stays safe. One
JSON summary goes to OUT.

Nothing counted depends on the machine's speed: every kill waits (on the disk, not on a clock)
until the saver committed a step newer than the last kill's, so training surely progresses
across kills; and the first kill lands surely mid-save: that saver holds its second save just
before the manifest (a marker file says so) until it is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from mithril_async import CheckpointManager
from tests.faults._common import (
    Counter,
    Net,
    leftovers,
    make_config,
    matches_step,
    metric,
    set_step,
)

RUN_ID = "killed"
#: seconds the server waits for a saver to reach a point: a safety net, not a timing
REACH_S = 180.0


def _hold_second_manifest(marker: Path) -> None:
    """In this (saver) process: let one manifest through, then hold the next one forever,
    after writing ``marker``: the save is then mid-flight until the SIGKILL."""
    from mithril_async.storage.local import LocalStore

    real = LocalStore.put_if_absent
    passed = [0]

    async def put_if_absent(store: LocalStore, key: str, data: Any) -> None:
        if key.endswith("manifest.json"):
            passed[0] += 1
            if passed[0] == 2:
                marker.write_text(key)
                await asyncio.Event().wait()  # until SIGKILLed
        await real(store, key, data)

    setattr(LocalStore, "put_if_absent", put_if_absent)  # noqa: B010 (a method swap)


def saver(runs: Path, hold: Path | None = None) -> None:
    if hold is not None:
        _hold_second_manifest(hold)
    model, counter = Net(), Counter()
    manager = CheckpointManager(make_config(runs, RUN_ID), {"model": model, "data": counter})
    step = max(manager.all_steps(), default=0)
    while True:
        step += 1
        set_step(model, counter, step)
        manager.save_nowait(step, metrics={"loss": metric(step)})


def verify(runs: Path) -> dict[str, Any]:
    root = runs / RUN_ID
    partial, tmps = leftovers(root)
    out: dict[str, Any] = {"partial": partial, "tmps": tmps, "errors": [],
                           "lagging_latest": _latest_lags(root)}
    err = out["errors"]
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(runs, RUN_ID), {"model": model, "data": counter}) as m:
        steps = m.all_steps()  # starting the manager cleaned the leftovers
        out["steps"] = steps
        after = leftovers(root)
        if after != ([], []):
            err.append(f"leftovers not cleaned at start: {after}")
        if steps:
            latest = m.restore_sync("latest")
            out["latest"] = latest
            if not matches_step(model, counter, latest):
                err.append(f"restore('latest') = step {latest} but the state differs")
            if latest != max(steps):
                err.append(f"latest names step {latest}, newest committed is {max(steps)}")
            best = m.best_step()
            if best is not None and metric(best) != min(metric(s) for s in steps):
                err.append(f"best names step {best} (loss {metric(best)}), committed {steps}")
            for s in steps:  # every manifest present names complete, verified blobs
                if m.restore_sync(s) != s or not matches_step(model, counter, s):
                    err.append(f"step {s} does not restore to its own state")
        elif (root / "aliases" / "latest.json").exists():
            err.append("latest alias exists but no version is committed")
    return out


def _latest_lags(root: Path) -> bool:
    """Whether the kill fell between a manifest and the move of ``latest`` to it."""
    steps = [json.loads(p.read_text())["step"]
             for p in (root / "versions").glob("*/manifest.json")]
    alias = root / "aliases" / "latest.json"
    current = json.loads(alias.read_text()).get("step") if alias.exists() else None
    return bool(steps) and current != max(steps)


def newest_committed(root: Path) -> int:
    """The highest step with a manifest on disk (0 if none); safe while a saver writes and
    retention deletes (manifests appear atomically: linked into place, complete)."""
    newest = 0
    for p in (root / "versions").glob("*/manifest.json"):
        try:
            newest = max(newest, int(json.loads(p.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            continue
    return newest


def wait_for(cond: Any, pid: int) -> tuple[str | None, int | None]:
    """Poll ``cond()`` until it holds. Returns (what went wrong, the saver's wait status if
    it already exited and was reaped): the saver exited, or REACH_S passed."""
    deadline = time.monotonic() + REACH_S
    while not cond():
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"saver exited early: {status}", status
        if time.monotonic() > deadline:
            return f"saver reached nothing in {REACH_S:g} s", None
        time.sleep(0.005)
    return None, None


def main() -> None:
    runs, kills, seed, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    rng = random.Random(seed)
    summary: dict[str, Any] = {"kills": 0, "verified": 0, "partial_seen": 0, "tmps_seen": 0,
                               "lagging_latest_seen": 0,
                               "max_step": 0, "failures": [], "delays": []}
    root = runs / RUN_ID
    for i in range(kills):
        before = newest_committed(root)
        hold = runs.parent / f"held-{i}" if i == 0 else None
        pid = os.fork()
        if pid == 0:
            try:
                saver(runs, hold)
            finally:
                os._exit(1)
        # the saver committed a step newer than before this kill (and, on the held kill, sits
        # before its second manifest); then a random delay moves the kill to a random point
        def reached(before: int = before, hold: Path | None = hold) -> bool:
            return newest_committed(root) > before and (hold is None or hold.exists())

        problem, status = wait_for(reached, pid)
        delay = 0.0 if hold is not None else rng.uniform(0.0, 0.5)
        if status is None:  # still running
            if problem is None:
                time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        if problem is not None or not (os.WIFSIGNALED(status)
                                       and os.WTERMSIG(status) == signal.SIGKILL):
            summary["failures"].append({"kill": i, "error": problem or f"saver exited: {status}"})
            continue
        summary["kills"] += 1
        summary["delays"].append(round(delay, 3))
        report = runs.parent / f"verify-{i}.json"
        vpid = os.fork()
        if vpid == 0:
            code = 0
            try:
                res = verify(runs)
            except BaseException:
                res, code = {"errors": [traceback.format_exc()]}, 1
            report.write_text(json.dumps(res))
            os._exit(code)
        _, status = os.waitpid(vpid, 0)
        res = json.loads(report.read_text()) if report.exists() else {"errors": ["no report"]}
        if res.get("errors") or status != 0:
            summary["failures"].append({"kill": i, **res})
            continue
        summary["verified"] += 1
        summary["partial_seen"] += bool(res["partial"])
        summary["tmps_seen"] += bool(res["tmps"])
        summary["lagging_latest_seen"] += bool(res["lagging_latest"])
        summary["max_step"] = max(summary["max_step"], max(res["steps"], default=0))
    Path(out).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
