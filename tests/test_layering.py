"""Which module may import which: the directions the package split relies on; and how large a
module, a function and the manager may grow.

Checked on the source (every import statement, function-level and TYPE_CHECKING ones too),
because importing :mod:`mithril_async` loads the whole library and ``sys.modules`` cannot tell
who imported what.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

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
    for codec in ("mithril_async.pipeline.blobs", "mithril_async.save.writers",
                  "mithril_async.save.chunks"):
        assert not [m for m in _imports(codec) if m.startswith(lossy)], codec


def test_step_deltas_never_import_the_save_pipelines_delta_chains() -> None:
    chains = {"mithril_async.save.xor_chain", "mithril_async.save.xor_choice"}
    for mod in pkgutil.iter_modules(step_deltas.__path__, "mithril_async.step_deltas."):
        assert not _imports(mod.name) & chains, mod.name


def _package_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (any import statement, TYPE_CHECKING too).

    ``from pkg import submodule`` is an edge to the submodule only: the package's
    ``__init__`` runs first either way, and counting it would make every sibling a loop."""
    spec = importlib.util.find_spec("mithril_async")
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    names = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in root.rglob("*.py")}
    native = {".".join((*p.relative_to(root.parent).parent.parts, p.name.split(".")[0]))
              for p in root.rglob("*.so")}  # the cffi extensions import nothing of ours
    graph: dict[str, set[str]] = {}
    for name in names:
        found = importlib.util.find_spec(name)
        assert found is not None and found.origin is not None
        deps: set[str] = set()
        for node in ast.walk(ast.parse(Path(found.origin).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & (names | native)
                deps |= subs if len(subs) == len(node.names) else subs | {node.module}
        graph[name] = {m for m in deps if m in names and m != name}
    return graph


def test_no_import_cycles_between_modules() -> None:
    """Not even under TYPE_CHECKING: a cycle there is a design loop that a refactor turns into
    an import error."""
    edges = _package_graph()
    cycles = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                cycles.append([*path[path.index(m):], m])
            elif m not in state:
                visit(m, [*path, m])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def _library_sources() -> list[Path]:
    spec = importlib.util.find_spec("mithril_async")
    assert spec is not None and spec.origin is not None
    return sorted(Path(spec.origin).parent.rglob("*.py"))


def test_rooms_stay_small_enough_to_change_safely() -> None:
    """No library module over 500 lines (the store conformance suite in testing/: 700), no
    function over 80, and the manager only wiring and lifecycle: <= 450 lines, <= 30
    methods."""
    too_big, too_long = [], []
    for path in _library_sources():
        text = path.read_text(encoding="utf-8")
        limit = 700 if path.parent.name == "testing" else 500
        if len(text.splitlines()) > limit:
            too_big.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    too_long.append(f"{path.name}:{node.name}: {length} lines")
    assert not too_big and not too_long, (too_big, too_long)
    manager = next(p for p in _library_sources() if p.name == "manager.py"
                   and p.parent.name == "mithril_async")
    text = manager.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 450
    cls = next(n for n in ast.parse(text).body
               if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager")
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= 30, [m.name for m in methods]
