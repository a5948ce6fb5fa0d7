"""Which module may import which: the directions the package split relies on.

Checked on the source (every import statement, function-level and TYPE_CHECKING ones too),
because importing :mod:`mithril_async` loads the whole library and ``sys.modules`` cannot tell
who imported what.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import mithril_async.delta as old_name
import mithril_async.step_deltas as step_deltas


def _imports(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    out: set[str] = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_analysis_computes_and_never_imports_what_writes_it() -> None:
    writers = {"mithril_async.step_deltas.report", "mithril_async.step_deltas.plots"}
    assert not _imports("mithril_async.step_deltas.analysis") & writers
    assert "mithril_async.step_deltas.analysis" in _imports("mithril_async.step_deltas.report")


def test_the_lossless_blob_codec_does_not_import_the_lossy_tier() -> None:
    lossy = ("mithril_async.lossy", "mithril_async.pipeline.lossy")
    assert not [m for m in _imports("mithril_async.pipeline.blobs") if m.startswith(lossy)]


def test_step_deltas_never_import_the_save_pipelines_delta_chains() -> None:
    chains = {"mithril_async.pipeline.chain", "mithril_async.pipeline.delta_choice"}
    for mod in pkgutil.iter_modules(step_deltas.__path__, "mithril_async.step_deltas."):
        assert not _imports(mod.name) & chains, mod.name


def test_mithril_async_delta_is_only_the_old_name_of_step_deltas() -> None:
    assert old_name.__all__ == step_deltas.__all__
    for name in step_deltas.__all__:
        if name != "SparseDeltaCallback":  # lazy: would import transformers
            assert getattr(old_name, name) is getattr(step_deltas, name), name
    assert not hasattr(old_name, "chain")
