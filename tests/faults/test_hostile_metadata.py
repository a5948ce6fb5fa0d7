"""Issue 8.8: hostile metadata - invalid JSON, schema violations, unknown schema versions,
``../`` / absolute / foreign keys, aliases pointing at missing versions, huge declared sizes
and huge files - gives typed errors naming the file, never a read or write outside the run
root and never a huge allocation. The manager still starts, and ``fallback=True`` still finds
the older intact version.
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mithril_async import CheckpointManager, MithrilError
from mithril_async.storage import local as local_mod
from tests.faults._common import Counter, Net, make_config, matches_step, metric, set_step

HUGE = 256 << 20  # a sparse file: no disk used, but reading it would allocate 256 MiB


def _manifest(v: Path) -> dict[str, Any]:
    return json.loads((v / "v000002" / "manifest.json").read_text())


def _put_manifest(v: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = _manifest(v)
    edit(doc)
    (v / "v000002" / "manifest.json").write_text(json.dumps(doc))


def _raw(data: bytes) -> Callable[[Path], None]:
    return lambda v: (v / "v000002" / "manifest.json").write_bytes(data)


def _model_key(key: str) -> Callable[[Path], None]:
    return lambda v: _put_manifest(v, lambda d: d["model"].__setitem__("key", key))


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(HUGE)


def _alias(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(v: Path) -> None:
        p = v.parent / "aliases" / "latest.json"
        doc = json.loads(p.read_text())
        edit(doc)
        p.write_text(json.dumps(doc))
    return apply


MANIFEST_CASES: dict[str, Callable[[Path], None]] = {
    "invalid-json": _raw(b"{not json"),
    "empty": _raw(b""),
    "not-an-object": _raw(b"[1, 2]"),
    "binary": _raw(bytes(range(256))),
    "schema-violation": lambda v: _put_manifest(
        v, lambda d: d["model"].__setitem__("bytes", -1)),
    "missing-field": lambda v: _put_manifest(v, lambda d: d.pop("resume")),
    "unknown-field": lambda v: _put_manifest(v, lambda d: d.__setitem__("evil", 1)),
    "unknown-schema-version": lambda v: _put_manifest(
        v, lambda d: d.__setitem__("schema_version", 2)),
    "dotdot-key": _model_key("runs/run1/../../../secret"),
    "absolute-key": _model_key("/etc/passwd"),
    "foreign-run-key": _model_key("runs/other/versions/v000001/model.mckp"),
    "reserved-key": _model_key("runs/run1/versions/v000002/.tmp-x"),
    "dotdot-rng-key": lambda v: _put_manifest(
        v, lambda d: d["rng"]["keys"][0].__setitem__("key", "../secret")),
    "dotdot-base-key": lambda v: _put_manifest(v, lambda d: d["model"].__setitem__(
        "base", {"version_id": "v000001", "key": "../../secret", "xxh64": "0" * 16})),
    "wrong-version-id": lambda v: _put_manifest(
        v, lambda d: d.__setitem__("version_id", "v000001")),
    "wrong-run-id": lambda v: _put_manifest(v, lambda d: d.__setitem__("run_id", "other")),
    "huge-declared-size": lambda v: _put_manifest(
        v, lambda d: d["model"].__setitem__("bytes", 1 << 50)),
    "huge-manifest-file": lambda v: _sparse(v / "v000002" / "manifest.json"),
    "huge-blob-file": lambda v: _sparse(v / "v000002" / "model.mckp"),
    "huge-rng-file": lambda v: _sparse(v / "v000002" / "rng_rank0000.json"),
}
ALIAS_CASES: dict[str, Callable[[Path], None]] = {
    "alias-missing-version": _alias(lambda d: d.update(
        manifest_key="runs/run1/versions/v000009/manifest.json", version_id="v000009")),
    "alias-dotdot": _alias(lambda d: d.update(manifest_key="runs/run1/../../secret")),
    "alias-absolute": _alias(lambda d: d.update(manifest_key="/etc/passwd")),
    "alias-foreign-run": _alias(lambda d: d.update(
        manifest_key="runs/other/versions/v000001/manifest.json")),
    "alias-invalid-json": lambda v: (v.parent / "aliases" / "latest.json").write_bytes(b"{"),
    "alias-huge-file": lambda v: _sparse(v.parent / "aliases" / "latest.json"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hostile")
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(base / "runs", delta=False),
                           {"model": model, "data": counter}) as m:
        for step in (1, 2):
            set_step(model, counter, step)
            m.save_nowait(step, metrics={"loss": metric(step)}).result()
    return base


class _Watch:
    """Records every path ``storage/local.py`` opens, creates or renames."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: str, *a: Any, **kw: Any) -> int:
        self.paths.append(path)
        return os.open(path, *a, **kw)

    def rename(self, src: str, dst: str) -> None:
        self.paths += [src, dst]
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        self.paths += [src, dst]
        os.link(src, dst)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self.paths.append(path)
        os.mkdir(path, mode)


@pytest.mark.parametrize("case", [*MANIFEST_CASES, *ALIAS_CASES])
def test_hostile_metadata_gives_typed_errors_only(pristine: Path, tmp_path: Path, case: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(pristine / "runs", tmp_path / "runs")
    (tmp_path / "secret").write_bytes(b"outside the run root")
    versions = tmp_path / "runs" / "run1" / "versions"
    (MANIFEST_CASES | ALIAS_CASES)[case](versions)
    outside_before = sorted(p.name for p in tmp_path.iterdir())
    watch = _Watch()
    monkeypatch.setattr(local_mod, "os", watch)
    model, counter = Net(), Counter()
    healed: list[str] = []
    tracemalloc.start()
    try:
        with CheckpointManager(make_config(tmp_path / "runs", delta=False),
                               {"model": model, "data": counter}) as m:
            where = "latest.json" if case.startswith("alias") else "v000002"
            if case == "alias-missing-version":
                where = "v000009"
            try:
                step = m.restore_sync("latest")
            except MithrilError as err:
                assert isinstance(err, (ValueError, FileNotFoundError)), repr(err)
                assert where in str(err), str(err)
            else:  # an unparseable alias is derived data: the start rewrote it
                assert case in ALIAS_CASES and step == 2 and matches_step(model, counter, 2)
                healed.append(case)
            if case in MANIFEST_CASES:  # the older version is intact and still found
                assert m.restore_sync("latest", fallback=True) == 1
                assert matches_step(model, counter, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB allocated"
    root = os.path.realpath(tmp_path / "runs")
    outside = [p for p in watch.paths if not os.path.realpath(p).startswith(root + os.sep)
               and not p.endswith(".tmp-cas.lock")]
    assert outside == []
    # nothing new beside the runs folder but the store's own lock file
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".tmp-cas.lock") == \
        outside_before
