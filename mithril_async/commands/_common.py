"""What every subcommand shares: finding runs on disk, reading versions, printing, progress.

Why here and not in the library: these helpers interpret *command-line paths* (a runs folder, a
run folder, a version folder, a manifest file) and print for humans or scripts; the library's
own pieces (LocalStore, RunLayout, RunCatalog, BlobCodec) do the real work. Everything here is
read-only except where a command says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from mithril_async.catalog import open_catalog
from mithril_async.errors import VersionNotFound

if TYPE_CHECKING:
    from mithril_async.catalog import RunCatalog
    from mithril_async.manifest import VersionManifest
    from mithril_async.storage.local import LocalStore

T = TypeVar("T")

#: exit code of a verification that found damage (1 = could not run, 2 = usage)
EXIT_CORRUPT = 3


@dataclass
class Target:
    """A command-line path, understood: which runs folder, which run(s), which version."""

    path: Path
    kind: str  # "runs" | "run" | "version" | "file"
    runs_dir: Path | None = None
    run_ids: list[str] = field(default_factory=list)
    version: str | None = None  # a version id for kind == "version"

    def store(self) -> LocalStore:
        from mithril_async.storage.local import LocalStore

        assert self.runs_dir is not None
        return LocalStore(self.runs_dir.parent)

    def catalog(self, run_id: str) -> RunCatalog:
        assert self.runs_dir is not None
        return open_catalog(self.runs_dir, run_id)


def _is_run_dir(p: Path) -> bool:
    return (p / "versions").is_dir() or (p / "run.json").is_file()


def locate(path: str) -> Target:
    """Classify ``path``; raise ``VersionNotFound`` (exit 1) naming it when it is no such thing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise VersionNotFound(f"{path}: no such file or directory")
    p = p.resolve()
    if p.is_file():
        if p.name == "manifest.json" and p.parent.parent.name == "versions":
            run = p.parent.parent.parent
            return Target(p, "version", run.parent, [run.name], p.parent.name)
        return Target(p, "file")
    if p.parent.name == "versions" and _is_run_dir(p.parent.parent):
        run = p.parent.parent
        return Target(p, "version", run.parent, [run.name], p.name)
    if _is_run_dir(p):
        return Target(p, "run", p.parent, [p.name])
    runs = sorted(c.name for c in p.iterdir() if c.is_dir() and _is_run_dir(c))
    if not runs:
        raise VersionNotFound(f"{path}: not a runs folder, run, version or checkpoint file "
                              "(no runs/<run_id>/versions/ inside)")
    return Target(p, "runs", p, runs)


def refuse_overwrite(out: Path, force: bool, command: str) -> bool:
    """Whether ``command`` must stop because ``out`` exists (said on stderr) and ``--force``
    was not given: the commands that write a file (restore, decompress) never replace one
    silently, so a mistyped path cannot cost a file the user wanted."""
    if force or not os.path.lexists(out):
        return False
    print(f"mithril {command}: error: {out} exists (use --force to replace it)", file=sys.stderr)
    return True


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def resolve_version(target: Target, run_id: str, version: str | None) -> str:
    """Manifest key of ``version`` ("latest", "best", "v000003", a step) in ``run_id``."""
    cat = target.catalog(run_id)
    want: str | int = version or target.version or "latest"
    if isinstance(want, str) and want.isdigit():
        want = int(want)
    return await cat.resolve(want)


def version_sizes(m: VersionManifest) -> tuple[int, int]:
    """(stored bytes, raw bytes) of a version's blobs."""
    blobs = m.blobs()
    return sum(b.bytes for b in blobs), sum(b.raw_bytes for b in blobs)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def ratio(raw: int, stored: int) -> float | None:
    return round(raw / stored, 3) if raw and stored else None


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def table(rows: list[list[str]], out: TextIO | None = None) -> None:
    """Print ``rows`` (first row = header) as left-aligned columns."""
    out = out or sys.stdout
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal (never in --json)."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {note[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def gather_versions(target: Target) -> dict[str, list[VersionManifest]]:
    """Committed versions of every run the target names (one version for a version target)."""
    out: dict[str, list[VersionManifest]] = {}
    for run_id in target.run_ids:
        cat = target.catalog(run_id)
        if target.kind == "version":
            key = await resolve_version(target, run_id, None)
            out[run_id] = [await cat.read_manifest(key)]
        else:
            out[run_id] = await cat.versions()
    return out
