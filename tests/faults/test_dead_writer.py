"""Temp files of a writer that is provably dead are removed at the next start whatever their
age, and never end up inside a committed version (issue 24).

A real writer process is SIGKILLed while its second save stands at a blob commit (the blob
written out in full as a temp file). It is not reaped before the next start: a killed process
stays a zombie until its parent waits for it, and a zombie's pid still answers ``kill(pid, 0)``;
the claim's owner is dead all the same. The run keeps ``orphan_age_s`` at 600 s, so the age
rule cannot be what removes the seconds-old temp files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mithril_async import CheckpointManager, parse_config

from ._dead_writer_child import Model, config_text, state

CHILD = Path(__file__).with_name("_dead_writer_child.py")


def _temps(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".tmp-*") if p.name != ".tmp-cas.lock")


def _state(pid: int) -> str:
    """The process state letter from /proc (``Z``: a zombie)."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rindex(b")") + 2:].split()[0].decode()


def _kill_mid_save(runs: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    ready = tmp_path / "ready"
    log = tmp_path / "child.log"
    child = subprocess.Popen([sys.executable, str(CHILD), str(runs), str(ready)],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not ready.exists():  # the child says when it stands at the blob commit
        if child.poll() is not None:
            pytest.fail("the writer ended by itself:\n" + log.read_text()[-4000:])
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    # not reaped: it becomes a zombie (its pid exists until the test waits for it); a
    # process being torn down still counts as running, so wait for the zombie state
    while _state(child.pid) != "Z":
        time.sleep(0.01)
    tmp = Path(ready.read_text())
    assert tmp.exists() and tmp.stat().st_size > 1 << 20, tmp
    return child


def _check_new_version(runs: Path, tmp_path: Path) -> None:
    """Start again: the temp files are gone at once; the next save commits a version
    folder that holds exactly its own files and restores exactly."""
    root = runs / "run1"
    assert _temps(root)
    model = Model()
    with CheckpointManager(parse_config(config_text(str(runs))), {"model": model}) as mgr:
        assert _temps(root) == []  # removed by the start, whatever their age
        model.set_step(2)
        vid = mgr.save_nowait(2).result().version_id
    assert vid is not None
    vdir = root / "versions" / vid
    manifest = json.loads((vdir / "manifest.json").read_text())
    inside = f"run1/versions/{vid}/"
    own = {k.split(inside, 1)[1] for k in _manifest_keys(manifest) if inside in k}
    assert "model.mckp" in own
    own |= {"manifest.json", "_claim.json"}
    assert {p.name for p in vdir.iterdir()} == own, sorted(p.name for p in vdir.iterdir())
    assert _temps(root) == []
    back = Model()
    with CheckpointManager(parse_config(config_text(str(runs))), {"model": back}) as mgr:
        assert mgr.restore_sync(vid) is not None
    assert torch.equal(back.w.detach(), state(2)["w"])


def _manifest_keys(doc: object) -> list[str]:
    """Every blob key a manifest names (``key`` fields at any depth)."""
    out: list[str] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k == "key" and isinstance(v, str):
                out.append(v)
            else:
                out += _manifest_keys(v)
    elif isinstance(doc, list):
        for v in doc:
            out += _manifest_keys(v)
    return out


def test_dead_writers_temp_files_go_at_the_next_start(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    child = _kill_mid_save(runs, tmp_path)
    try:
        assert (runs / "run1" / "versions" / "v000002" / "_claim.json").exists()
        _check_new_version(runs, tmp_path)
    finally:
        child.wait()


def test_a_claimless_folder_of_leftovers_is_cleaned_and_never_reused(tmp_path: Path) -> None:
    """The killed writer's claim and files are gone but its temp files are not (a removal
    killed half-way: the cleanup used to delete a folder's files and claim before its temp
    files). A folder holding only temp files is invisible to listings, so its number used to
    be claimed again and the next save committed the dead writer's temp files inside its
    version (how the issue found 123 MB of them in a re-committed ``v000003``)."""
    runs = tmp_path / "runs"
    child = _kill_mid_save(runs, tmp_path)
    try:
        vdir = runs / "run1" / "versions" / "v000002"
        for p in vdir.iterdir():
            if not p.name.startswith(".tmp-"):
                p.unlink()
        assert _temps(vdir)
        _check_new_version(runs, tmp_path)
    finally:
        child.wait()


def test_claim_never_reuses_a_folder_holding_leftovers(tmp_path: Path) -> None:
    """Even before any cleanup: the number of a folder with leftovers is skipped."""
    import asyncio

    from mithril_async.catalog import open_catalog

    vdir = tmp_path / "run1" / "versions" / "v000001"
    vdir.mkdir(parents=True)
    (vdir / ".tmp-model.mckp.1.abcd").write_bytes(b"x" * 100)
    claim = asyncio.run(open_catalog(tmp_path, "run1").claim())
    assert claim.number == 2
    assert [p.name for p in vdir.iterdir()] == [".tmp-model.mckp.1.abcd"]
