"""Crash-safe file replacement, in one place: temp file beside the target, write, fsync the
file, rename it over the target, fsync the directory.

A reader (or a machine that lost power) then sees the old file or the new one, never a torn
one: the rename is atomic, the file fsync makes the data durable before the name points at it,
and the directory fsync makes the rename itself durable.

:func:`atomic_write` and :func:`atomic_file` are the whole recipe for callers that write a
file at once (:class:`~mithril_async.compressor.Compressor`, the safetensors and Lightning
outputs). :class:`~mithril_async.storage.local.LocalStore` needs its own order of steps around
them (parents created and fsynced, ``link`` for create-only writes, a lock for
compare-and-swap), so it uses the pieces: :func:`temp_path`, :func:`create_temp`,
:func:`write_all`, :func:`fsync_dir`.

The pieces that touch the disk take ``fs``, the ``os`` functions to call (default: :mod:`os`).
LocalStore passes its own module's ``os`` so that every system call of a save goes through one
seam, which the fault-injection and power-loss tests replace.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from typing import IO, Protocol

from mithril_async.storage.base import RESERVED_PREFIX

__all__ = [
    "FileOps",
    "atomic_file",
    "atomic_write",
    "create_temp",
    "fsync_dir",
    "temp_path",
    "unlink_quiet",
    "write_all",
]

_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


class FileOps(Protocol):
    """The ``os`` functions the helpers call (the :mod:`os` module itself satisfies it)."""

    def open(self, path: str, flags: int, mode: int = 0o777, /) -> int: ...

    def write(self, fd: int, data: bytes | bytearray | memoryview, /) -> int: ...

    def fsync(self, fd: int, /) -> None: ...

    def close(self, fd: int, /) -> None: ...

    def rename(self, src: str, dst: str, /) -> None: ...

    def unlink(self, path: str, /) -> None: ...


def temp_path(path: str) -> str:
    """A fresh temp name in ``path``'s folder: ``.tmp-<name>.<pid>.<random>``.

    Same folder, so the final rename never crosses a file system; the reserved ``.tmp-``
    prefix keeps it out of store listings and lets ``cleanup_incomplete`` find the leftovers
    of a killed writer (the name is cut to 100 characters so it stays a valid file name)."""
    base = os.path.basename(path)[:100]
    name = f"{RESERVED_PREFIX}{base}.{os.getpid()}.{secrets.token_hex(4)}"
    return os.path.join(os.path.dirname(path), name)


def create_temp(path: str, *, mode: int = 0o644, fs: FileOps = os) -> tuple[int, str]:
    """Create (exclusively) and open a temp file beside ``path``; return (fd, temp path).
    ``mode`` is the new file's permissions before the umask."""
    tmp = temp_path(path)
    return fs.open(tmp, _TEMP_FLAGS, mode), tmp


def write_all(fd: int, data: bytes | bytearray | memoryview, *, fs: FileOps = os) -> None:
    """Write all of ``data`` (``os.write`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = fs.write(fd, view)
        view = view[n:]


def fsync_dir(path: str, *, fs: FileOps = os) -> None:
    """Make the names in directory ``path`` durable (a rename, link or unlink in it)."""
    fd = fs.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def unlink_quiet(path: str, *, fs: FileOps = os) -> None:
    """Remove ``path`` if it is there (a temp file a failed write leaves behind)."""
    with contextlib.suppress(FileNotFoundError):
        fs.unlink(path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[IO[bytes]]:
    """Open a temp file beside ``path`` for writing; when the block ends normally it is
    fsynced and renamed over ``path`` and the folder is fsynced. An exception removes it and
    leaves ``path`` as it was. ``durable=False`` skips both fsyncs (throwaway outputs)."""
    dst = os.fspath(path)
    fd, tmp = create_temp(dst, mode=0o666)  # as open() does: the output follows the umask
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.rename(tmp, dst)
    except BaseException:
        unlink_quiet(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(dst)))


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview | Callable[[IO[bytes]], object],
    *,
    durable: bool = True,
) -> None:
    """Replace ``path`` with ``data``, or with what ``data(f)`` writes to the binary file
    ``f`` (e.g. ``lambda f: torch.save(obj, f)``), crash-safely (see :func:`atomic_file`).
    The folder must exist."""
    with atomic_file(path, durable=durable) as f:
        if callable(data):
            data(f)
        else:
            f.write(data)
