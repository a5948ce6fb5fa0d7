"""A journaling ``os`` shim for :mod:`mithril_async.storage.local` and a model of what a power
loss leaves on disk.

:class:`Journal` replaces the ``os`` module *inside* ``storage/local.py`` only (its sibling
``local_*.py`` modules reach that ``os`` through ``LocalStore.fs``). Every call that
changes the file system (create, write, fsync of a file, fsync of a directory, rename, link,
unlink, mkdir, rmdir) is forwarded to the real ``os`` and recorded in order; reads pass
through untouched. :meth:`Journal.image` then answers: if the power had failed right after the
first ``n`` recorded operations, which files would exist and what would they hold?

The model is the usual POSIX worst case (what ext4/xfs promise, no more):

- file data reaches the disk only through ``fsync`` of that file: bytes written after the last
  fsync of an inode are lost (the inode keeps its content as of that fsync, empty if never);
- a name change (create, rename, link, unlink, mkdir, rmdir) in directory ``D`` survives only if
  ``D`` itself was fsynced afterwards (``world="synced"``). A second world, ``"names"``, lets
  every completed name change survive while unsynced data is still lost: the classic
  "rename reached the disk, the data did not" torn file.

Files that existed when recording started count as durable.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

World = Literal["synced", "names"]
_NAME_OPS = ("create", "rename", "link", "unlink", "mkdir", "rmdir")


@dataclass
class Op:
    kind: str
    path: str
    dst: str = ""
    ino: int = -1
    data: bytes = b""

    @property
    def dir(self) -> str:
        return os.path.dirname(self.path)


@dataclass
class _Fd:
    ino: int
    is_dir: bool
    path: str


@dataclass
class Journal:
    root: str
    ops: list[Op] = field(default_factory=list)
    _fds: dict[int, _Fd] = field(default_factory=dict)
    _inos: dict[str, int] = field(default_factory=dict)  # live name -> inode (files only)
    _initial: dict[str, bytes | None] = field(default_factory=dict)  # None: a directory
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next_ino: int = 0

    def __post_init__(self) -> None:
        for dirpath, dirnames, filenames in os.walk(self.root):
            for d in dirnames:
                self._initial[os.path.join(dirpath, d)] = None
            for f in filenames:
                p = os.path.join(dirpath, f)
                with open(p, "rb") as fh:
                    self._initial[p] = fh.read()
                self._inos[p] = self._new_ino()

    def _new_ino(self) -> int:
        self._next_ino += 1
        return self._next_ino

    def _log(self, op: Op) -> None:
        self.ops.append(op)

    # -- the os shim -----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:  # constants, os.path, scandir, stat, pread...
        return getattr(os, name)

    def open(self, path: str, flags: int, mode: int = 0o777, **kw: Any) -> int:
        with self._lock:
            existed = os.path.lexists(path)
            fd = os.open(path, flags, mode, **kw)
            if path.endswith(".tmp-cas.lock"):
                return fd
            if flags & os.O_DIRECTORY:
                self._fds[fd] = _Fd(-1, True, path)
            elif flags & (os.O_WRONLY | os.O_RDWR):
                if not existed:
                    ino = self._new_ino()
                    self._inos[path] = ino
                    self._log(Op("create", path, ino=ino))
                self._fds[fd] = _Fd(self._inos[path], False, path)
            return fd

    def write(self, fd: int, data: Any) -> int:
        n = os.write(fd, data)
        with self._lock:
            f = self._fds.get(fd)
            if f is not None and not f.is_dir:
                self._log(Op("write", f.path, ino=f.ino, data=bytes(memoryview(data)[:n])))
        return n

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        with self._lock:
            f = self._fds.get(fd)
            if f is not None:
                self._log(Op("fsync_dir" if f.is_dir else "fsync", f.path, ino=f.ino))

    def close(self, fd: int) -> None:
        os.close(fd)
        with self._lock:
            self._fds.pop(fd, None)

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            os.rename(src, dst)
            ino = self._inos.pop(src)
            self._inos[dst] = ino
            self._log(Op("rename", src, dst, ino=ino))

    def link(self, src: str, dst: str) -> None:
        with self._lock:
            os.link(src, dst)
            self._inos[dst] = self._inos[src]
            self._log(Op("link", src, dst, ino=self._inos[src]))

    def unlink(self, path: str) -> None:
        with self._lock:
            os.unlink(path)
            self._inos.pop(path, None)
            self._log(Op("unlink", path))

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        with self._lock:
            os.mkdir(path, mode)
            self._log(Op("mkdir", path))

    def rmdir(self, path: str) -> None:
        with self._lock:
            os.rmdir(path)
            self._log(Op("rmdir", path))

    # -- the crash model -------------------------------------------------------------------
    def crash_points(self) -> list[int]:
        """Every n after which the durable state may differ from n - 1 (commit points)."""
        return [0] + [i + 1 for i, op in enumerate(self.ops) if op.kind != "write"]

    def image(self, n: int, world: World) -> dict[str, bytes | None]:
        """Path -> content (``None`` for a directory) surviving a power loss after ``n`` ops."""
        ops = self.ops[:n]
        synced_after: dict[str, int] = {}  # directory -> index of its last fsync
        for i, op in enumerate(ops):
            if op.kind == "fsync_dir":
                synced_after[op.path] = i
        # names: path -> inode (or None for directories)
        names: dict[str, int | None] = {}
        ino_of_initial: dict[int, bytes] = {}
        for p, content in self._initial.items():
            if content is None:
                names[p] = None
        content_now: dict[int, bytearray] = {}
        durable: dict[int, bytes] = {}
        # initial files keep their inode numbers 1..k in walk order
        k = 0
        for p, content in self._initial.items():
            if content is not None:
                k += 1
                names[p] = k
                ino_of_initial[k] = content
                durable[k] = content
                content_now[k] = bytearray(content)
        for i, op in enumerate(ops):
            if op.kind == "write":
                content_now.setdefault(op.ino, bytearray()).extend(op.data)
                continue
            if op.kind == "fsync":
                durable[op.ino] = bytes(content_now.get(op.ino, b""))
                continue
            if op.kind == "fsync_dir":
                continue
            d = os.path.dirname(op.dst or op.path)
            if op.kind == "rename":
                assert os.path.dirname(op.path) == d, op  # every rename stays in its folder
            survives = world == "names" or synced_after.get(d, -1) > i
            if not survives:
                continue
            if op.kind == "create":
                names[op.path] = op.ino
                content_now.setdefault(op.ino, bytearray())
            elif op.kind == "rename":
                names[op.dst] = names.pop(op.path, op.ino)
            elif op.kind == "link":
                names[op.dst] = op.ino
            elif op.kind in ("unlink", "rmdir"):
                names.pop(op.path, None)
            elif op.kind == "mkdir":
                names[op.path] = None
        out: dict[str, bytes | None] = {}
        for p, ino in names.items():
            parent = os.path.dirname(p)
            ok = True
            while parent != self.root and parent.startswith(self.root):
                if parent not in names or names[parent] is not None:
                    ok = False
                    break
                parent = os.path.dirname(parent)
            if ok:
                out[p] = None if ino is None else durable.get(ino, b"")
        return out

    def materialize(self, n: int, world: World, dest: Path) -> None:
        """Write :meth:`image` under ``dest`` (same relative paths as under ``root``)."""
        for p, content in sorted(self.image(n, world).items()):
            target = dest / os.path.relpath(p, self.root)
            if content is None:
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
