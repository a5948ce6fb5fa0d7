"""Opening and reading the files of a :class:`~mithril_async.storage.local.LocalStore`.

A key's file is opened read-only, never through a symlink, and non-blocking, so a FIFO planted
at a key cannot hang the open; ``fstat`` on the descriptor itself then refuses anything but a
regular file (no race with a rename) before the descriptor is made blocking again.
:class:`LocalRangeReader` serves many ranged reads through one such descriptor.

Every system call goes through the store's file system module (``fs``, the store's ``os``), the
one name the fault and power-loss tests replace.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from types import ModuleType
from typing import Protocol

from mithril_async.errors import StorageError
from mithril_async.storage.base import check_range

#: flags of every read open: no symlink, and no hang on a FIFO
OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class StoreFiles(Protocol):
    """What a reader of a store's file needs of the store: its file system module and its
    mapping of an ``OSError`` to the store's typed errors."""

    @property
    def fs(self) -> ModuleType: ...

    def _error(self, exc: OSError, op: str, key: str, path: str, *,
               reading: bool) -> Exception: ...


class NotRegularFile(OSError):
    """A key's path holds something other than a file or folder (a FIFO, a socket, a
    device): never a stored value, so refused (:class:`UnsafeKey` naming the key)."""

    def __init__(self, kind: str, path: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)
        self.kind = kind


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_regular(mode: int, path: str) -> None:
    """Refuse what is not a regular file: a folder is no key (KeyNotFound, as a missing
    file), anything else is :class:`NotRegularFile`."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    raise NotRegularFile(kind, path)


def open_file(fs: ModuleType, path: str) -> int:
    """A blocking read-only descriptor of the regular file at ``path`` (no symlink, no
    folder, no FIFO or device). Opened non-blocking, so a FIFO cannot hang the open; checked
    by ``fstat`` on the descriptor itself (no race with a rename); then made blocking."""
    fd: int = fs.open(path, OPEN_FLAGS)
    try:
        check_regular(fs.fstat(fd).st_mode, path)
        fs.set_blocking(fd, True)
    except BaseException:
        fs.close(fd)
        raise
    return fd


def pread(fs: ModuleType, fd: int, start: int, length: int) -> bytes:
    """``length`` bytes at ``start`` of ``fd`` (fewer only at its end)."""
    parts: list[bytes] = []
    pos, left = start, length
    while left > 0:
        chunk = fs.pread(fd, left, pos)
        if not chunk:
            break
        parts.append(chunk)
        pos += len(chunk)
        left -= len(chunk)
    return b"".join(parts)


class LocalRangeReader:
    """Ranged reads of one file of a :class:`LocalStore` on the calling thread, through one
    descriptor opened (confined, no symlink) by :meth:`LocalStore.open_range_reader`; errors
    are the store's typed ones, as from ``get_range``. Thread-safe: reads may run on several
    threads at once, and :meth:`close` closes the descriptor only once none is running (a
    read still running when its caller gave up never reads another file through a reused
    descriptor number)."""

    def __init__(self, store: StoreFiles, key: str, path: str, fd: int) -> None:
        self._store, self._key, self._path, self._fd = store, key, path, fd
        self._lock = threading.Lock()
        self._busy = 0
        self._closing = False

    def read(self, start: int, length: int) -> bytes:
        check_range(self._key, start, length)
        with self._lock:
            if self._closing:
                raise StorageError(errno.EBADF, f"get_range {self._key!r}: reader closed",
                                   self._path)
            self._busy += 1
        try:
            return pread(self._store.fs, self._fd, start, length)
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise self._store._error(exc, "get_range", self._key, self._path,
                                     reading=True) from exc
        finally:
            with self._lock:
                self._busy -= 1
                last = self._closing and self._busy == 0
            if last:
                self._close_fd()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._busy == 0
        if idle:
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self._store.fs.close(fd)
