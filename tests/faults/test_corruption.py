"""Issue 8.7 and 8.9: damaged blobs and broken delta chains are never loaded silently.

Each corruption (a flipped bit, one byte truncated, a zero-length blob, a blob of another
version, blobs swapped between versions, a damaged RNG/data-state file) makes ``restore`` raise
``ChecksumMismatch``/``InvalidFormat`` naming the file, makes ``mithril verify`` exit 3 naming
it, and ``restore(fallback=True)`` load the newest version that verifies (and log it).
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mithril_async import CheckpointManager, InvalidFormat, MissingPrevious
from mithril_async.cli import main as cli_main
from tests.faults._common import (
    LONG,
    Counter,
    Net,
    make_config,
    matches_step,
    metric,
    scale,
    set_step,
)


def _run(runs: Path, n: int, **kw: object) -> Path:
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(runs, keep_last=100, **kw),  # type: ignore[arg-type]
                           {"model": model, "data": counter}) as m:
        for step in range(1, n + 1):
            set_step(model, counter, step)
            m.save_nowait(step, metrics={"loss": metric(step)}).result()
    return runs / "run1" / "versions"


Corrupt = Callable[[Path], str]  # damages a run's versions folder; returns the damaged key


def _flip(rel: str, where: float, bit: int = 0) -> Corrupt:
    def corrupt(v: Path) -> str:
        p = v / rel
        data = bytearray(p.read_bytes())
        i = min(len(data) - 1, int(len(data) * where))
        data[i] ^= 1 << bit
        p.write_bytes(bytes(data))
        return rel
    return corrupt


def _truncate(v: Path) -> str:
    p = v / "v000003/model.mckp"
    p.write_bytes(p.read_bytes()[:-1])
    return "v000003/model.mckp"


def _empty(v: Path) -> str:
    (v / "v000003/model.mckp").write_bytes(b"")
    return "v000003/model.mckp"


def _wrong_version(v: Path) -> str:
    shutil.copy(v / "v000002/model.mckp", v / "v000003/model.mckp")
    return "v000003/model.mckp"


def _swapped(v: Path) -> str:
    a, b = v / "v000002/model.mckp", v / "v000003/model.mckp"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    return "v000003/model.mckp"


def _rng_edit(v: Path) -> str:
    """A damaged data-state file that is still valid JSON: the step 3 -> 2."""
    p = v / "v000003/rng_rank0000.json"
    text = p.read_text()
    assert '"step": 3' in text
    p.write_text(text.replace('"step": 3', '"step": 2', 1))
    return "v000003/rng_rank0000.json"


def _manifest_step_edit(v: Path) -> str:
    """The manifest carries no checksum of its own: its step altered (3 -> 2), still valid."""
    p = v / "v000003/manifest.json"
    text = p.read_text()
    assert '"step": 3,' in text
    p.write_text(text.replace('"step": 3,', '"step": 2,', 1))
    return "v000003/manifest.json"


CASES: dict[str, Corrupt] = {
    "bitflip-header": _flip("v000003/model.mckp", 0.01),
    "bitflip-data": _flip("v000003/model.mckp", 0.5, 3),
    "bitflip-trailer": _flip("v000003/model.mckp", 0.999, 7),
    "truncated": _truncate,
    "zero-length": _empty,
    "wrong-version": _wrong_version,
    "swapped": _swapped,
    "rng-json-edit": _rng_edit,
    "rng-bitflip": _flip("v000003/rng_rank0000.json", 0.3, 0),
    "manifest-step-edit": _manifest_step_edit,
}
if LONG:  # a flipped bit at many random places of every file of the version
    rnd = random.Random()
    for i in range(200):
        name = rnd.choice(["model.mckp", "rng_rank0000.json"])
        CASES[f"random-{i}-{name}"] = _flip(f"v000003/{name}", rnd.random(), rnd.randrange(8))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("pristine") / "runs"
    _run(runs, 3, delta=False)
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_corruption_is_detected_and_fallback_loads_the_previous_version(
        pristine: Path, tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(pristine, runs)
    damaged = CASES[case](runs / "run1" / "versions")
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(runs, keep_last=100, delta=False),
                           {"model": model, "data": counter}) as m:
        with pytest.raises(InvalidFormat, match=damaged.replace(".", r"\.")):
            m.restore_sync("latest", verify="whole")  # untouched: the blob's own error
        # (the fallback restores one pass, verify="block": a partial overwrite is repaired)
        # swapping damages v2 as well; a manifest claiming step 2 sends fallback below 2
        good = 1 if case in ("swapped", "manifest-step-edit") else 2
        with caplog.at_level(logging.WARNING, logger="mithril_async"):
            assert m.restore_sync("latest", fallback=True) == good
        assert matches_step(model, counter, good)
        assert "fell back from v000003" in caplog.text
    capsys.readouterr()
    assert cli_main(["verify", str(runs / "run1")]) == 3
    err = capsys.readouterr().err
    assert damaged in err or (case == "swapped" and "v000002/model.mckp" in err), err


# ----------------------------------------------------------------------------- delta chains
DELTA_CASES: dict[str, tuple[Callable[[Path], None], type[Exception]]] = {
    "corrupt-base": (lambda v: _flip("v000004/model.mckp", 0.5)(v), InvalidFormat),
    "missing-base-blob": (lambda v: (v / "v000004/model.mckp").unlink(), MissingPrevious),
    "missing-base-manifest": (lambda v: (v / "v000004/manifest.json").unlink(), MissingPrevious),
    "base-replaced": (lambda v: shutil.copy(v / "v000001/model.mckp", v / "v000004/model.mckp"),
                      InvalidFormat),
}


@pytest.mark.parametrize("case", list(DELTA_CASES))
def test_broken_delta_chain_is_never_a_silent_wrong_restore(tmp_path: Path, case: str) -> None:
    versions = _run(tmp_path / "runs", 5, delta=True)  # v4 keyframe, v5 = delta on v4
    damage, error = DELTA_CASES[case]
    damage(versions)
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(tmp_path / "runs", keep_last=100),
                           {"model": model, "data": counter}) as m:
        with pytest.raises(error, match="v000004"):
            m.restore_sync(5)
        assert m.restore_sync(5, fallback=True) == 3  # v3 = delta on v2 on v1: intact
        assert matches_step(model, counter, 3)


def test_retention_never_deletes_a_base_a_kept_version_needs(tmp_path: Path) -> None:
    """keep_last = 1 over a delta chain: after every save, every kept version restores."""
    runs = tmp_path / "runs"
    cfg = make_config(runs, keep_last=1)
    model, counter = Net(), Counter()
    r_model, r_counter = Net(), Counter()
    with CheckpointManager(cfg, {"model": model, "data": counter}) as m:
        for step in range(1, scale(8, 30) + 1):
            set_step(model, counter, step)
            m.save_nowait(step, metrics={"loss": metric(step)}).result()
            with CheckpointManager(cfg, {"model": r_model, "data": r_counter}) as r:
                kept = r.all_steps()
                assert step in kept  # with its bases, and best with its bases
                for s in kept:
                    assert r.restore_sync(s) == s and matches_step(r_model, r_counter, s)
    assert len(kept) < step  # retention did delete what no kept version needs
