"""A cleaner never deletes a version committed while it ran.

``mithril gc`` (and a manager's start-up clean-up) first lists the abandoned version folders,
then removes them. Meanwhile a restarting job may clean the same folder itself, claim the
same number (the next above the newest folder) and commit a new version there. The cleaner
is a real process, held between its plan and its removals by a gate (a line on its stdin),
and the job commits in this process while it waits: after the gate opens, the new version
must be intact and ``restore("latest")`` must return it bit for bit.

The removal itself (:meth:`RunCatalog.remove_unfinished`) is also checked directly for each
way a folder stops being abandoned: its claim replaced, revived, or a manifest written.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager
from mithril_async.catalog import RunCatalog
from mithril_async.claims import claim_token
from mithril_async.layout import RunLayout
from mithril_async.storage.memory import MemoryStore

from ._common import Counter, Net, make_config, matches_step, set_step

REPO = Path(__file__).resolve().parents[2]
V2 = "run1/versions/v000002"  # below the runs folder; gc names it from the store root
V2_KEY = f"runs/{V2}"


def _save(runs: Path, step: int) -> str:
    """A job's manager (its start cleans the run) saving ``step``; the committed version."""
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(runs, delta=False),
                           {"model": model, "data": counter}) as mgr:
        set_step(model, counter, step)
        vid = mgr.save_nowait(step).result().version_id
    assert vid is not None
    return vid


def _abandoned_v2(runs: Path, *, claim: bool) -> None:
    """v000002 as a dead writer left it: a partial blob, with its claim (heartbeat long
    stopped) or without one (a removal cut short after the claim)."""
    v2 = runs / V2
    v2.mkdir(parents=True)
    (v2 / "model.mckp").write_bytes(b"partial")
    if claim:
        doc = {"host": "gone.invalid", "pid": 1, "t": 0, "hb": 0, "token": "dead writer"}
        (v2 / "_claim.json").write_text(json.dumps(doc))


def _held_cleaner(mode: str, runs: Path, log: Path) -> tuple[subprocess.Popen[str], Any]:
    """Start the cleaner and wait until it has made its plan (it prints it, then waits)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.faults._gc_child", mode, str(runs)], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith("planned "):
        child.kill()
        child.wait()
        pytest.fail(f"the cleaner made no plan: {line!r}\n{log.read_text()[-4000:]}")
    return child, json.loads(line.split(" ", 1)[1])


def _open_gate(child: subprocess.Popen[str], log: Path) -> str:
    out, _ = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, log.read_text()[-4000:]
    return out


def _restores_latest(runs: Path, step: int) -> None:
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(runs, delta=False),
                           {"model": model, "data": counter}) as mgr:
        assert mgr.restore_sync("latest") == step
    assert matches_step(model, counter, step)


def _commit_while_held(tmp_path: Path, mode: str, *, claim: bool) -> tuple[Path, Any, str]:
    """v000001 committed, v000002 abandoned; the cleaner plans and waits at its gate; a
    restarting job cleans v000002 itself, claims the number again and commits there; then
    the gate opens. Returns (runs folder, the cleaner's plan, what it printed after)."""
    runs = tmp_path / "runs"
    assert _save(runs, 1) == "v000001"
    _abandoned_v2(runs, claim=claim)
    log = tmp_path / f"{mode}.log"
    child, plan = _held_cleaner(mode, runs, log)
    try:
        assert _save(runs, 2) == "v000002"
    finally:
        out = _open_gate(child, log)
    return runs, plan, out


@pytest.mark.parametrize("claim", [True, False], ids=["stale-claim", "claimless"])
def test_gc_leaves_a_version_committed_between_its_plan_and_apply(
        tmp_path: Path, claim: bool) -> None:
    runs, plan, out = _commit_while_held(tmp_path, "gc", claim=claim)
    assert ["unfinished", V2_KEY] in plan
    assert (runs / V2 / "manifest.json").exists()
    report = json.loads(out)
    [item] = [i for i in report["runs"]["run1"] if i["what"] == V2_KEY]
    assert item["kind"] == "skip" and item["why"].startswith("left alone"), item
    assert report["bytes"] == 0
    _restores_latest(runs, 2)


def test_a_start_up_clean_up_leaves_a_version_committed_meanwhile(tmp_path: Path) -> None:
    runs, stale, out = _commit_while_held(tmp_path, "start", claim=True)
    assert stale == [2]
    assert out.strip() == "removed []", out
    _restores_latest(runs, 2)


# -------------------------------------------------------------- the removal, in-process

class _CommitsOnTakeOver(MemoryStore):
    """A store on which a writer publishes its manifest right after a cleaner took the
    claim over (a writer that had passed its claim check just before)."""

    manifest = ""

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        tag = await super().put_if_match(key, data, etag)
        if self.manifest and key.endswith("_claim.json"):
            await self.put(self.manifest, b"{}")
            self.manifest = ""
        return tag


def _claim_doc(token: str, hb: float) -> bytes:
    return json.dumps({"host": "gone.invalid", "pid": 1, "t": hb, "hb": hb,
                       "token": token}).encode()


def test_remove_unfinished_refuses_what_changed_since_the_judgement() -> None:
    store = _CommitsOnTakeOver()
    cat = RunCatalog(store, RunLayout("runs", "run1"))
    lay = cat.layout

    async def body() -> None:
        for n in (2, 3, 4, 5, 6):
            await store.put(lay.model_key(n, "mckp"), b"partial")
        await store.put(lay.claim_key(2), _claim_doc("new owner", 0))  # replaced
        await store.put(lay.claim_key(3), _claim_doc("dead", time.time()))  # beating again
        await store.put(lay.claim_key(4), _claim_doc("dead", 0))
        await store.put(lay.manifest_key(4), b"{}")  # committed meanwhile
        await store.put(lay.claim_key(5), _claim_doc("dead", 0))  # committed on take-over
        store.manifest = lay.manifest_key(5)
        reasons = {n: await cat.remove_unfinished(n, "dead") for n in (2, 3, 4, 5)}
        assert reasons[2] is not None and "claimed by another process" in reasons[2]
        assert reasons[3] is not None and "live again" in reasons[3]
        assert reasons[4] is not None and "committed" in reasons[4]
        assert reasons[5] is not None and "committed" in reasons[5]
        for n in (2, 3, 4, 5):
            assert await store.exists(lay.model_key(n, "mckp")), n
        # the committed version keeps the claim it had, not the cleaner's
        assert json.loads(await store.get(lay.claim_key(5)))["token"] == "dead"
        # a claimless folder that got a claim since is refused; one still claimless goes
        await store.put(lay.claim_key(6), _claim_doc("a writer", time.time()))
        assert await cat.remove_unfinished(6, None) is not None
        await store.delete(lay.claim_key(6))
        assert await cat.remove_unfinished(6, None) is None
        assert await store.list(lay.version_dir(6) + "/") == []
        # the judged claim, still abandoned: removed, claim last, nothing left
        await store.put(lay.claim_key(7), _claim_doc("dead", 0))
        await store.put(lay.model_key(7, "mckp"), b"partial")
        stale, _ = await cat.unfinished()
        assert claim_token(stale[7]) == "dead"
        assert await cat.remove_unfinished(7, claim_token(stale[7])) is None
        assert await store.list(lay.version_dir(7) + "/") == []

    asyncio.run(body())


def test_gc_apply_checks_committed_versions_against_its_plan(tmp_path: Path) -> None:
    """A retention victim replaced by another version under its number is kept; an orphan
    whose version is unchanged still goes."""
    from mithril_async.cli import build_parser
    from mithril_async.commands._common import locate
    from mithril_async.commands.gc import apply_run, plan_run

    runs = tmp_path / "runs"
    for step in (1, 2):
        _save(runs, step)
    orphan = runs / "run1/versions/v000002/extra.bin"
    orphan.write_bytes(b"left by nobody")
    args = build_parser().parse_args(["gc", str(runs), "--keep-last", "1"])
    target = locate(str(runs))
    plan = asyncio.run(plan_run(target, "run1", args))
    assert {(i["kind"], i["what"]) for i in plan} == {
        ("retention", "v000001"), ("orphan", "runs/run1/versions/v000002")}
    # meanwhile v000001 is deleted and another version committed under its number
    cat = target.catalog("run1")
    asyncio.run(cat.delete_version("v000001"))
    doc = json.loads((runs / "run1/versions/v000002/manifest.json").read_text())
    doc.update(version_id="v000001", created_at="2001-01-01T00:00:00Z")
    v1 = runs / "run1/versions/v000001"
    v1.mkdir()
    (v1 / "manifest.json").write_text(json.dumps(doc))
    asyncio.run(apply_run(target, "run1", plan, args))
    assert (v1 / "manifest.json").exists()
    assert [i["why"] for i in plan if i["kind"] == "skip"] == [
        "left alone: another version was committed as v000001 since gc looked"]
    assert not orphan.exists()
