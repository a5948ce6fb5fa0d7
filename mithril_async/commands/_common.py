"""What every subcommand shares: finding runs on disk, reading versions, printing, progress
bars.

Why here and not in the library: these helpers interpret *command-line paths* (a runs folder, a
run folder, a version folder, a manifest file) and print for humans or scripts; the library's
own pieces (LocalStore, RunLayout, RunCatalog, BlobCodec) do the real work. Everything here is
read-only except where a command says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
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


#: how often a progress bar is redrawn at most (seconds): the work reports every chunk, the
#: terminal sees a few updates a second
PROGRESS_INTERVAL_S = 0.2


class ProgressBar:
    """A byte progress bar on stderr (tqdm: bytes done, total, rate, ETA), for long commands.

    Shown only when ``enabled`` and stderr is a terminal; otherwise nothing is printed, tqdm
    is never imported, and :attr:`callback` is None so the work runs exactly as without a bar.
    Make one with :func:`progress_bar` (which reads ``--json`` / ``--quiet``) and use it as a
    context manager (the bar's last line stays on screen when it closes)::

        with progress_bar(args, "export", total=nbytes) as bar:
            export(..., progress=bar.callback)            # callback(n): n more bytes done
            export(..., on_progress=bar.update_to)        # or update_to(done, total)

    ``advance`` / ``update_to`` may be called from any thread and as often as the work likes
    (every chunk): they only add to a counter, and the terminal is redrawn at most every
    :data:`PROGRESS_INTERVAL_S` seconds (and when the bar closes). ``total`` None: bytes and
    rate without a percentage or ETA. :meth:`stage` starts the next phase on a new line
    (``read``, then ``write``).
    """

    def __init__(self, label: str, total: int | None = None, *, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None
        self._lock = threading.Lock()
        self._pending = 0  # counted, not yet shown
        self._done = 0
        self._last = 0.0
        if self.enabled:
            self._open(label, total)

    @property
    def done(self) -> int:
        """Bytes counted in the current stage (0 when the bar is not shown)."""
        return self._done

    @property
    def total(self) -> int | None:
        """The current stage's total (None: unknown, or the bar is not shown)."""
        return None if self._bar is None else self._bar.total

    @property
    def callback(self) -> Callable[[int], None] | None:
        """:meth:`advance` when the bar is shown, else None (for a ``progress=`` parameter:
        the work then makes no calls at all)."""
        return self.advance if self.enabled else None

    def _open(self, label: str, total: int | None) -> None:
        try:
            cols, rows = os.get_terminal_size(sys.stderr.fileno())
        except OSError:
            cols = rows = 0
        # a terminal that reports no size (an unsized pseudo-terminal) gets 80x24: tqdm would
        # print nothing in 0 columns or 0 rows
        size: dict[str, Any] = ({"dynamic_ncols": True} if cols and rows else
                                {"ncols": cols or 80, "nrows": rows or 24})
        self._bar = _tqdm_class()(total=total, desc=label, unit="B", unit_scale=True,
                                  unit_divisor=1024, file=sys.stderr, mininterval=0,
                                  miniters=1, leave=True, **size)
        self._pending = self._done = 0
        self._last = time.monotonic()

    def advance(self, n: int) -> None:
        """``n`` more bytes done."""
        if self._bar is None:
            return
        with self._lock:
            self._pending += n
            self._done += n
            now = time.monotonic()
            if now - self._last >= PROGRESS_INTERVAL_S:
                self._flush(now)

    def update_to(self, done: int, total: int | None = None) -> None:
        """``done`` bytes done so far of ``total`` (None: the total stays as it was)."""
        if self._bar is None:
            return
        if total is not None and total != self._bar.total:
            with self._lock:
                self._bar.total = total
                self._bar.refresh()
        self.advance(done - self._done)

    def _flush(self, now: float) -> None:
        if self._pending:
            self._bar.update(self._pending)
            self._pending = 0
        self._last = now

    def stage(self, label: str, total: int | None = None) -> None:
        """Leave the current bar's last state on screen and count the next phase from 0."""
        if self._bar is None:
            return
        self.close()
        self._open(label, total)

    def close(self) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._flush(time.monotonic())
        self._bar.close()
        self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def _tqdm_class() -> type:
    """tqdm without its monitor thread: :class:`ProgressBar` decides when to redraw."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar


def shows_progress(args: argparse.Namespace) -> bool:
    """Whether the command shows a progress bar: stderr is a terminal and neither ``--json``
    nor ``--quiet`` was given (work done only for the bar, such as reading a header for its
    total, is skipped otherwise)."""
    quiet = getattr(args, "json", False) or getattr(args, "quiet", False)
    return not quiet and sys.stderr.isatty()


def progress_bar(args: argparse.Namespace, label: str, total: int | None = None
                 ) -> ProgressBar:
    """The command's progress bar (:class:`ProgressBar`), shown when
    :func:`shows_progress` and there is something to count (``total`` is not 0)."""
    return ProgressBar(label, total, enabled=shows_progress(args) and total != 0)


def decompress_total(args: argparse.Namespace, src: str | os.PathLike[str], out: Path
                     ) -> int | None:
    """The bytes ``decompress_file(src, out, progress=...)`` reports, for a progress bar's
    total: the raw bytes ``src``'s header declares (decoded), twice for a ``.safetensors``
    output (then written). Only the trailer, header and index are read, and only when the bar
    shows; None when ``src`` cannot be read as an ``.mckp`` (the decompression then says
    why)."""
    from mithril_async.codec.container_read import MckpRangeReader
    from mithril_async.errors import MithrilError

    if not shows_progress(args):
        return None
    try:
        with open(src, "rb") as f:
            def read_range(offset: int, length: int) -> bytes:
                f.seek(offset)
                return f.read(length)

            raw = MckpRangeReader(read_range, os.fstat(f.fileno()).st_size).open().original_size
    except (MithrilError, OSError, ValueError):
        return None
    return raw * (2 if out.suffix == ".safetensors" else 1)


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
