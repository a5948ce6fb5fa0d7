"""The documentation: page sizes, headings, links and the generated configuration reference.

- docs/BENCHMARKS.md holds each benchmark's current table only (<= 40 KB); no other page of
  docs/ is over 30 KB; README.md stays under 12 KB and opens with the two commands;
- no heading anywhere in docs/ names an issue number (or a seed item): headings say what a
  section is about, history goes to CHANGELOG.md;
- every relative link of README.md, CHANGELOG.md and docs/ resolves on GitHub: the file
  exists and its anchor is a heading (GitHub's slugs) or an explicit ``<a id>``;
- the configuration reference the docs site renders from the pydantic models
  (tools/config_reference.py) names every key of every table, with its default.

`make docs` (mkdocs --strict, run by `make test`) checks the same links on the site.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
KB = 1000
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) (.*)$")
#: pages the docs site generates (tools/mkdocs_hooks.py); not in the repository
GENERATED = {(DOCS / "reference" / "config.md").resolve()}
ISSUE = re.compile(r"\b(issue|seed|item)s?\s*#?\d+|#\d+\b", re.IGNORECASE)


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _outside_fences(text: str) -> list[tuple[int, str]]:
    out, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fence = not fence
        elif not fence:
            out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    for _, line in _outside_fences(text):
        match = HEADING.match(line)
        if match:
            slug = github_slug(match[2])
            count = seen.get(slug)
            seen[slug] = 0 if count is None else count + 1
            found.add(slug if count is None else f"{slug}-{count + 1}")
    return found


def test_page_sizes() -> None:
    assert (DOCS / "BENCHMARKS.md").stat().st_size <= 40 * KB
    too_big = {str(p.relative_to(ROOT)): p.stat().st_size for p in _pages()
               if p.name != "BENCHMARKS.md" and p.stat().st_size > 30 * KB}
    assert not too_big, f"pages over 30 KB (split them): {too_big}"
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 12 * KB
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block[:2]] == [["make", "demo"], ["make", "test"]]


def test_no_heading_names_an_issue() -> None:
    bad = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in _pages()
           for n, line in _outside_fences(p.read_text())
           if HEADING.match(line) and ISSUE.search(line)]
    assert not bad, "headings naming an issue number:\n" + "\n".join(bad)


def test_relative_links_resolve() -> None:
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *_pages()]:
        for n, line in _outside_fences(page.read_text()):
            for href in LINK.findall(line):
                if re.match(r"^[a-z]+:", href):
                    continue
                path, _, frag = href.partition("#")
                target = page if not path else (page.parent / path)
                if target.resolve() in GENERATED:
                    continue  # made by the site build, which checks links to it (--strict)
                where = f"{page.relative_to(ROOT)}:{n}: {href}"
                if not target.exists():
                    broken.append(f"{where} (no such file)")
                elif frag and target.suffix == ".md" and frag not in anchors(target.read_text()):
                    broken.append(f"{where} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _config_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "tools" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_config_reference_names_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from mithril_async.config import CheckpointingConfig

    monkeypatch.setenv("MITHRIL_PROCESS", "inline")  # the page shows the default, not the env's
    ref = _config_reference()
    page = ref.render()
    rows = {}
    for table, model in ref.tables(CheckpointingConfig, "checkpointing"):
        section = page.split(f"## `[{table}]`", 1)[1].split("\n## ", 1)[0]
        for key, info in model.model_fields.items():
            row = re.search(rf"^\| `{re.escape(key)}` \| [^\n]*$", section, re.M)
            assert row is not None, f"{table}.{key} missing from the generated reference"
            rows[f"{table}.{key}"] = row[0]
            assert f"`{ref.default_of(info)}`" in row[0], (table, key, row[0])
    expected = set(ref.keys(CheckpointingConfig, "checkpointing"))
    assert set(rows) == expected and "checkpointing.pipeline.process" in expected
    assert "`\"worker\"`" in rows["checkpointing.pipeline.process"]
    assert "checkpointing.tiers.local" in expected
