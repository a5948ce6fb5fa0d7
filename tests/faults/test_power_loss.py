"""Issue 8.2: a power loss at any commit point leaves every alias naming an old or a new
version, never a torn one. ``storage/local.py`` runs on a journaling ``os`` shim
(``_powerloss.py``); for every prefix of the journal and both crash worlds we build the disk
image that would survive and check it with a fresh manager.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from mithril_async import CheckpointManager
from mithril_async.manifest import AliasFile, parse_model
from mithril_async.storage import local as local_mod
from tests.faults._common import LONG, Counter, Net, make_config, matches_step, metric, set_step
from tests.faults._powerloss import Journal, World

WORLDS: tuple[World, ...] = ("synced", "names")


def _record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, delta: bool
            ) -> tuple[Journal, Path]:
    """Save step 1 normally, then steps 2 and 3 (retention deletes v1) under the journal."""
    live = tmp_path / "live"
    cfg = make_config(live / "runs", keep_last=2, delta=delta)
    model, counter = Net(), Counter()
    with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
        set_step(model, counter, 1)
        m.save_nowait(1, metrics={"loss": metric(1)}).result()
        journal = Journal(os.path.realpath(live))
        monkeypatch.setattr(local_mod, "os", journal)
        for step in (2, 3):
            set_step(model, counter, step)
            m.save_nowait(step, metrics={"loss": metric(step)}).result()
        monkeypatch.setattr(local_mod, "os", os)
    return journal, live


def _check_image(img: Path, delta: bool) -> tuple[int, list[int]]:
    """Everything a reader can see in a crashed image is a complete, verified version."""
    root = img / "runs" / "run1"
    named: dict[str, int] = {}
    for name in ("latest", "best"):
        alias_file = root / "aliases" / f"{name}.json"
        if alias_file.exists():  # parses (never torn) and names a committed version
            alias = parse_model(AliasFile, alias_file.read_bytes(), str(alias_file))
            if alias.status == "ok":
                assert alias.step in (1, 2, 3)
                assert (img / str(alias.manifest_key)).exists(), f"{name} names a lost version"
                named[name] = int(alias.step or 0)
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(img / "runs", keep_last=2, delta=delta),
                           {"model": model, "data": counter}) as m:
        steps = m.all_steps()
        assert steps, "the version committed before the crash is gone"
        latest = m.restore_sync("latest")
        assert matches_step(model, counter, latest)
        assert latest == max(steps) >= named.get("latest", 0)
        for s in steps:
            assert m.restore_sync(s) == s and matches_step(model, counter, s)
        best = m.best_step()
        assert best is not None and metric(best) == min(metric(s) for s in steps)
    return latest, steps


@pytest.mark.parametrize("delta", [False, True] if LONG else [False],
                         ids=["full", "delta"][:2 if LONG else 1])
def test_power_loss_at_every_commit_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          delta: bool) -> None:
    journal, _live = _record(tmp_path, monkeypatch, delta=delta)
    kinds = {op.kind for op in journal.ops}
    assert {"create", "fsync", "fsync_dir", "rename", "link", "unlink"} <= kinds, kinds
    points = journal.crash_points()
    seen: dict[str, tuple[int, list[int]]] = {}
    latest_by_point = []
    for n in points:
        for world in WORLDS:
            image = journal.image(n, world)
            digest = hashlib.sha256(json.dumps(
                sorted((p, None if c is None else hashlib.sha256(c).hexdigest())
                       for p, c in image.items())).encode()).hexdigest()
            if digest not in seen:
                img = tmp_path / "img"
                shutil.rmtree(img, ignore_errors=True)
                journal.materialize(n, world, img)
                try:
                    seen[digest] = _check_image(img, delta)
                except Exception as err:  # any failure, typed or not, names the crash
                    ops = [f"{o.kind} {os.path.relpath(o.path, journal.root)}"
                           for o in journal.ops[max(0, n - 6):n]]
                    raise AssertionError(f"crash after op {n} ({world}): {err}; last ops {ops}"
                                         ) from err
            if world == "synced":
                latest_by_point.append(seen[digest][0])
    # durable progress is monotone: once step k is the newest, a later crash never shows less
    assert latest_by_point == sorted(latest_by_point)
    assert latest_by_point[0] == 1 and latest_by_point[-1] == 3
    _record_count(len(points), len(seen))


def _record_count(points: int, images: int) -> None:
    print(f"power loss: {points} crash points, {images} distinct images checked")
