"""Retention: one policy built from the config (or injected), one planner for manager and gc."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mithril_async import CheckpointManager
from mithril_async.catalog import open_catalog
from mithril_async.config import parse_config
from mithril_async.manifest import VersionManifest
from mithril_async.retention import (
    KeepAny,
    KeepBestN,
    KeepEveryNSteps,
    KeepLastN,
    from_config,
    from_options,
    plan_deletions,
)
from tests.manager.conftest import make_state, train_step


def _cfg(text: str) -> Any:
    return parse_config("[checkpointing]\n" + text).checkpointing


def test_from_config_maps_the_flat_options_to_one_policy() -> None:
    assert from_config(_cfg("")) is None
    assert from_config(_cfg("keep_last = 3")) == KeepLastN(3)
    both = from_config(_cfg('keep_last = 2\nkeep_best = 1\nbest_metric_name = "loss"\n'
                            "keep_every_n_steps = 100"))
    assert both == KeepAny((KeepLastN(2), KeepBestN(1, "loss", "min"), KeepEveryNSteps(100)))
    # no best metric: there is no best to keep
    assert from_config(_cfg("keep_best = 2")) is None
    assert from_options(keep_last=0, keep_every_n_steps=0) is None


class KeepEvenSteps:
    """A policy a user writes: anything with keep(versions) -> ids."""

    def keep(self, versions: Sequence[VersionManifest]) -> set[str]:
        return {v.version_id for v in versions if v.step % 2 == 0}


def _run(make_config: Any, retention: Any = "config", steps: int = 5, **kw: Any) -> list[int]:
    model, opt, batcher = make_state()
    extra = {} if retention == "config" else {"retention": retention}
    with CheckpointManager(make_config(**kw), {"model": model, "optimizer": opt}, **extra) as m:
        for step in range(1, steps + 1):
            train_step(model, opt, batcher)
            m.save_nowait(step).result()
        assert m.retention is (None if retention is None else m.retention)
        return m.all_steps()


def test_a_policy_object_can_be_injected(make_config: Any) -> None:
    # 1 and 3 go; 5 is the newest (and latest) and is always kept
    assert _run(make_config, KeepEvenSteps()) == [2, 4, 5]


def test_retention_none_keeps_everything_whatever_the_config_says(make_config: Any) -> None:
    assert _run(make_config, None, keep_last=1) == [1, 2, 3, 4, 5]


def test_left_out_the_config_decides(make_config: Any) -> None:
    assert _run(make_config, keep_last=2) == [4, 5]


def test_gc_plans_with_the_same_planner(make_config: Any, tmp_path: Path) -> None:
    _run(make_config, None)
    runs = tmp_path / "runs"
    planned = asyncio.run(plan_deletions(open_catalog(runs, "run1"), KeepLastN(2)))
    assert [v.step for v in planned] == [3, 2, 1]  # newest first
    out = subprocess.run([sys.executable, "-m", "mithril_async.cli", "gc", str(runs / "run1"),
                          "--keep-last", "2", "--dry-run", "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    gone = [i["what"] for i in doc["runs"]["run1"] if i["kind"] == "retention"]
    assert gone == [v.version_id for v in planned]
    subprocess.run([sys.executable, "-m", "mithril_async.cli", "gc", str(runs / "run1"),
                    "--keep-last", "2"], capture_output=True, check=True)
    steps = [v.step for v in asyncio.run(open_catalog(runs, "run1").versions())]
    assert steps == [4, 5]
