"""mkdocs hooks of the docs site (mkdocs.yml ``hooks``).

- ``on_files`` adds ``reference/config.md``, rendered from the pydantic models by
  :mod:`config_reference` at build time, so the reference cannot drift from the code.
- ``on_page_markdown`` turns links that leave ``docs/`` (``../README.md``,
  ``../tests/faults/README.md``, ...) into links to the file in the repository: they work on
  GitHub as written and on the site through ``repo_url``. A link to a file that does not exist
  is reported as a warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import config_reference

log = logging.getLogger("mkdocs.hooks.mithril")
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^\s*(```|~~~)")


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/config.md", content=config_reference.render()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    src = (docs / page.file.src_path).parent
    base = str(config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match[str]) -> str:
        href = match[2]
        path, _, frag = href.partition("#")
        if not path or re.match(r"^[a-z]+:", href):
            return match[0]
        target = (src / path).resolve()
        if target.is_relative_to(docs):
            return match[0]
        if not target.exists():
            log.warning("%s: link to %s, which does not exist", page.file.src_path, href)
            return match[0]
        kind = "tree" if target.is_dir() else "blob"
        url = f"{base}/{kind}/main/{target.relative_to(repo).as_posix()}"
        return f"{match[1]}{url}{'#' + frag if frag else ''}{match[3]}"

    out, fence = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fence = not fence
        out.append(line if fence else _LINK.sub(rewrite, line))
    return "\n".join(out)
