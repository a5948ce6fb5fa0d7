"""An ``os`` shim for :mod:`mithril_async.storage.local` that fails the N-th mutating call.

Counted calls: ``open`` for writing, ``write``, ``fsync`` (files and directories), ``rename``,
``link`` and ``mkdir`` - everything a save does to the disk except removing its own leftovers.
``arm(n, errno)`` makes the n-th counted call from now raise ``OSError(errno)`` (once).
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from typing import Any


class FaultOS:
    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None
        self.code = errno_mod.EIO
        self.fired: str | None = None
        self._lock = threading.Lock()

    def arm(self, n: int | None, code: int = errno_mod.EIO) -> None:
        with self._lock:
            self.calls, self.fail_at, self.code, self.fired = 0, n, code, None

    def _tick(self, what: str) -> None:
        with self._lock:
            self.calls += 1
            if self.calls == self.fail_at:
                self.fired = what
                raise OSError(self.code, f"{os.strerror(self.code)} (injected at {what})")

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: str, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) and not path.endswith(".tmp-cas.lock"):
            self._tick(f"open {os.path.basename(path)}")
        return os.open(path, flags, mode, **kw)

    def write(self, fd: int, data: Any) -> int:
        self._tick("write")
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        self._tick("fsync")
        os.fsync(fd)

    def rename(self, src: str, dst: str) -> None:
        self._tick(f"rename {os.path.basename(dst)}")
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        self._tick(f"link {os.path.basename(dst)}")
        os.link(src, dst)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._tick(f"mkdir {os.path.basename(path)}")
        os.mkdir(path, mode)
