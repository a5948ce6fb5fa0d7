"""A Store on the local file system: temp file + fsync + rename, never a torn file.

The steps are the pieces of :mod:`mithril_async.storage.atomic`, called with this module's
``os`` (``fs=os``), so every system call of a save goes through one name that the fault and
power-loss tests replace. The sibling modules (``local_reads``: opening and ranged reads;
``local_writer``: the streaming writer; ``local_listing``: the folder walks; ``local_lock``: the
compare-and-swap lock) reach that same ``os`` through :attr:`LocalStore.fs`.

Every blocking call runs on a worker thread (``asyncio.to_thread``), one hop per operation
rather than one per syscall, so the event loop never waits on the disk.

Safety: keys are validated with :func:`check_key`, the resolved parent directory must stay
inside the root (symlinked directories pointing elsewhere are refused) and the final component
is opened with ``O_NOFOLLOW`` so a planted symlink cannot redirect a read outside the root.
Reads open with ``O_NONBLOCK`` and refuse anything but a regular file before reading: a FIFO
planted at a key would otherwise hang the open (and a restore with it) until some process
opened its other end. ``O_NONBLOCK`` is cleared again on the regular file's descriptor.

Conditional writes: ``put_if_absent`` hard-links a fully written temp file into place
(``link`` fails atomically if the name exists). ``put_if_match`` compares a content-hash tag
and renames under an ``flock`` on ``<root>/.tmp-cas.lock``, which excludes other
``put_if_match`` callers in this and other processes on the same machine (not plain ``put``).
The tag is a hash of the content, so it never repeats for different data (an inode+mtime tag
can, once an inode is reused within one clock tick). The lock file is created 0600 (anyone who
can open it can take the lock) and the wait for it is bounded (``lock_timeout_s``): a holder
that never lets go fails a save with :class:`~mithril_async.errors.LockTimeout` naming the
lock instead of hanging every save of the store.

``put_private`` writes a file only its owner can read (0600): what a run records of its
configuration goes through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable, Collection
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from mithril_async.errors import (
    KeyExists,
    KeyNotFound,
    PreconditionFailed,
    StorageError,
    UnsafeKey,
)
from mithril_async.storage import local_listing, local_reads
from mithril_async.storage.atomic import create_temp, fsync_dir, unlink_quiet, write_all
from mithril_async.storage.base import (
    DirListing,
    Incomplete,
    Leftovers,
    check_key,
    check_prefix,
    check_range,
    skipped,
)
from mithril_async.storage.local_lock import LOCK_NAME, LOCK_TIMEOUT_S, PRIVATE_MODE, cas_lock
from mithril_async.storage.local_reads import LocalRangeReader, NotRegularFile
from mithril_async.storage.local_writer import LocalWriter

__all__ = [
    "FILE_MODE",
    "LOCK_NAME",
    "LOCK_TIMEOUT_S",
    "PRIVATE_MODE",
    "LocalRangeReader",
    "LocalStore",
    "LocalWriter",
    "NotRegularFile",
    "content_tag",
]

T = TypeVar("T")

_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
#: permissions of a store's files (before the umask); private ones get ``PRIVATE_MODE``
FILE_MODE = 0o644


def content_tag(data: bytes | memoryview) -> str:
    """The etag of a value: size + BLAKE2b-128 of the content."""
    return f"{len(data):x}-{hashlib.blake2b(data, digest_size=16).hexdigest()}"


class LocalStore:
    """Keys map to files under ``root``; see the module docstring for guarantees."""

    atomic_conditional_writes = True

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True,
                 lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        """``durable=False`` skips fsyncs (only for tests/benchmarks on throwaway dirs).
        ``lock_timeout_s``: the longest a conditional write waits for the store's lock."""
        if not lock_timeout_s >= 0:
            raise ValueError(f"lock_timeout_s must be >= 0, got {lock_timeout_s!r}")
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self.url = f"file://{self.root}/"
        self.durable = durable
        self.lock_timeout_s = lock_timeout_s

    @property
    def fs(self) -> ModuleType:
        """The ``os`` every system call of this store goes through: this module's, looked up
        at each use, so the tests that replace it reach the sibling modules' calls too."""
        return os

    # -- paths and errors ------------------------------------------------------------------
    def local_path(self, key: str) -> Path:
        """The file that holds ``key`` (validated, inside the root). Blocking: it resolves
        symlinks, so call it off the event loop where the disk may be slow."""
        path = self._path(key)
        self._confine(path)
        return Path(path)

    def _inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)

    def _path(self, key: str) -> str:
        """Lexical path of a validated key; no I/O, so safe on the event loop."""
        return os.path.join(self.root, check_key(key))

    def _confine(self, path: str) -> None:
        """Refuse a path whose parent directory resolves outside the root (a symlinked
        directory). Does I/O: runs on the worker thread with the operation itself."""
        if not self._inside(os.path.realpath(os.path.dirname(path))):
            key = os.path.relpath(path, self.root)
            raise UnsafeKey(f"store key {key!r} resolves outside {self.url} (symlinked directory)")

    def _check_prefix_dir(self, norm: str) -> None:
        """Refuse a list/cleanup prefix that climbs out of the root through a symlink."""
        if norm and not self._inside(os.path.realpath(os.path.join(self.root, norm))):
            raise UnsafeKey(f"store prefix {norm!r} resolves outside {self.url}")

    def _error(self, exc: OSError, op: str, key: str, path: str, *, reading: bool) -> Exception:
        if exc.errno == errno.ELOOP:
            return UnsafeKey(f"{op} {key!r}: {path} is a symlink, refused")
        if isinstance(exc, NotRegularFile):
            return UnsafeKey(f"{op} {key!r}: {path} is {exc.kind}, not a regular file; refused")
        if reading and exc.errno in _MISSING:
            return KeyNotFound(exc.errno, f"{op}: key {key!r} not found in {self.url}", path)
        code = exc.errno if exc.errno is not None else errno.EIO
        return StorageError(code, f"{op} {key!r} failed: {exc.strerror or exc}", path)

    async def _run(
        self, op: str, key: str, fn: Callable[[str], T], *, reading: bool, path: str | None = None,
        discard: Callable[[T], None] | None = None,
    ) -> T:
        p = self._path(key) if path is None else path

        def confined() -> T:
            if path is None:
                self._confine(p)
            return fn(p)

        # A cancelled caller waits for the worker thread: the thread cannot be stopped, so
        # the operation's effect (a claim linked, a file renamed) is settled before the
        # CancelledError propagates and the caller's cleanup can see and undo it. What the
        # caller can never see, a result it would have owned (an open file), is ``discard``ed.
        task = asyncio.ensure_future(asyncio.to_thread(confined))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is None and discard is not None:
                discard(task.result())
            raise
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise self._error(exc, op, key, p, reading=reading) from exc

    def _fsync(self, fd: int) -> None:
        if self.durable:
            os.fsync(fd)

    def _sync_dir(self, path: str) -> None:
        if self.durable:
            fsync_dir(path, fs=os)  # this module's ``os``: the seam the fault tests replace

    def _replace(self, tmp: str, path: str) -> None:
        """Rename a written temp file over ``path`` and make the rename durable."""
        os.rename(tmp, path)
        self._sync_dir(os.path.dirname(path))

    def _makedirs(self, d: str) -> None:
        """Create missing parents of a key, fsyncing each new entry so it survives a crash."""
        missing: list[str] = []
        cur = d
        while not os.path.isdir(cur):
            missing.append(cur)
            cur = os.path.dirname(cur)
        for m in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(m)
            self._sync_dir(os.path.dirname(m))
        if missing and not self._inside(os.path.realpath(d)):
            raise UnsafeKey(f"directory {d} resolves outside {self.url}")

    def _create_tmp(self, path: str, mode: int = FILE_MODE) -> tuple[int, str]:
        """Open a fresh temp file next to ``path``; retried if a concurrent delete pruned
        the (empty) directory between mkdir and open."""
        self._confine(path)
        for attempt in range(5):
            self._makedirs(os.path.dirname(path))
            try:
                return create_temp(path, mode=mode, fs=os)
            except FileNotFoundError:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _write_tmp(self, path: str, data: bytes | memoryview, mode: int = FILE_MODE) -> str:
        fd, tmp = self._create_tmp(path, mode)
        try:
            write_all(fd, data, fs=os)
            self._fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp, fs=os)
            raise
        os.close(fd)
        return tmp

    def _prune(self, d: str) -> None:
        """Remove now-empty parent directories up to (not including) the root."""
        while d != self.root and self._inside(d):
            try:
                os.rmdir(d)
            except OSError:
                return
            d = os.path.dirname(d)

    def _cas_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the store's compare-and-swap lock (:func:`~.local_lock.cas_lock`)."""
        return cas_lock(os, self.root, self.lock_timeout_s, self.url)

    # -- reads -----------------------------------------------------------------------------
    @staticmethod
    def _read(path: str) -> bytes:
        with open(local_reads.open_file(os, path), "rb", buffering=0, closefd=True) as f:
            return f.read()

    async def get(self, key: str) -> bytes:
        return await self._run("get", key, self._read, reading=True)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)

        def read_range(path: str) -> bytes:
            fd = local_reads.open_file(os, path)
            try:
                return local_reads.pread(os, fd, start, length)
            finally:
                os.close(fd)

        return await self._run("get_range", key, read_range, reading=True)

    async def open_range_reader(self, key: str) -> LocalRangeReader | None:
        """One open file for many ranged reads on a worker thread (see
        :class:`~mithril_async.storage.capabilities.RangeReading`). None for a subclass that
        reads ranges its own way (overrides :meth:`get_range`): that way stays in use."""
        if type(self).get_range is not LocalStore.get_range:
            return None
        path = self._path(key)
        fd = await self._run("get_range", key, lambda p: local_reads.open_file(os, p),
                             reading=True, discard=os.close)
        return LocalRangeReader(self, key, path, fd)

    async def size(self, key: str) -> int:
        def stat_size(path: str) -> int:
            st = os.stat(path, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, "symlink", path)
            local_reads.check_regular(st.st_mode, path)
            return st.st_size

        return await self._run("size", key, stat_size, reading=True)

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except KeyNotFound:
            return False
        return True

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        data = await self.get(key)
        return data, await asyncio.to_thread(content_tag, data)

    # -- writes ----------------------------------------------------------------------------
    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._put("put", key, data, FILE_MODE)

    async def put_private(self, key: str, data: bytes | memoryview) -> None:
        """As :meth:`put`, but the file is readable and writable by its owner only (0600):
        for what must not be shared with every user who can read the store."""
        await self._put("put_private", key, data, PRIVATE_MODE)

    async def _put(self, op: str, key: str, data: bytes | memoryview, mode: int) -> None:
        def put(path: str) -> None:
            tmp = self._write_tmp(path, data, mode)
            try:
                self._replace(tmp, path)
            except BaseException:
                unlink_quiet(tmp, fs=os)  # gone already if only the directory fsync failed
                raise

        await self._run(op, key, put, reading=False)

    def _link_or_fail(self, tmp: str, path: str) -> bool:
        """Publish ``tmp`` at ``path`` only if absent; False if the name already exists."""
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:  # file systems without hard links: fall back under the lock
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            with self._cas_lock():
                if os.path.lexists(path):
                    return False
                os.rename(tmp, path)
        self._sync_dir(os.path.dirname(path))
        return True

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        def put_if_absent(path: str) -> bool:
            if os.path.lexists(path):  # cheap early exit; the link below is the real check
                return False
            tmp = self._write_tmp(path, data)
            try:
                return self._link_or_fail(tmp, path)
            finally:
                unlink_quiet(tmp, fs=os)

        if not await self._run("put_if_absent", key, put_if_absent, reading=False):
            raise KeyExists(errno.EEXIST, f"key {key!r} already exists in {self.url}", key)

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        new_tag = await asyncio.to_thread(content_tag, data)

        def put_if_match(path: str) -> tuple[bool, str | None]:
            tmp = self._write_tmp(path, data)
            try:
                with self._cas_lock():
                    try:
                        current: str | None = content_tag(self._read(path))
                    except (FileNotFoundError, NotADirectoryError):
                        current = None
                    if current != etag:
                        return False, current
                    if etag is None:
                        if not self._link_or_fail(tmp, path):  # created by a plain put
                            return False, "<created concurrently>"
                    else:
                        self._replace(tmp, path)
                return True, None
            finally:
                unlink_quiet(tmp, fs=os)

        won, found = await self._run("put_if_match", key, put_if_match, reading=False)
        if not won:
            raise PreconditionFailed(
                errno.EAGAIN,
                f"conditional write of {key!r} in {self.url} lost: expected etag {etag!r}, "
                f"found {found!r}",
                key,
            )
        return new_tag

    async def delete(self, key: str) -> None:
        def delete(path: str) -> None:
            try:
                os.unlink(path)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return
            except PermissionError:
                if os.path.isdir(path):  # Linux reports EPERM for unlink() of a directory
                    return
                raise
            try:
                self._sync_dir(os.path.dirname(path))
            except FileNotFoundError:
                # a concurrent delete of the folder's last other file removed the emptied
                # folder: nothing is left to sync (deletes of one version run concurrently)
                return
            self._prune(os.path.dirname(path))

        await self._run("delete", key, delete, reading=False)

    def open_writer(self, key: str) -> LocalWriter:
        return LocalWriter(self, key, self._path(key))

    # -- listing and cleanup ---------------------------------------------------------------
    def _top(self, norm: str) -> str:
        """The folder of the normalised prefix ``norm``, refused if it climbs out of the root
        through a symlink. Does I/O: runs on the worker thread."""
        self._check_prefix_dir(norm)
        return os.path.join(self.root, norm) if norm else self.root

    def _keys(self, norm: str, sized: bool) -> dict[str, int]:
        """Worker-thread body of the listings: the keys under ``norm``, sorted, from one walk,
        each with its size where ``sized`` (else 0: nothing is stat'ed)."""
        return local_listing.sized_keys(os, self._top(norm), norm, sized)

    async def list(self, prefix: str) -> list[str]:
        norm = check_prefix(prefix)
        return list(await self._run("list", norm or ".", lambda _: self._keys(norm, False),
                                    reading=True, path=self.root))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` with its size, from one directory walk
        (:class:`~mithril_async.storage.capabilities.SizedListing`)."""
        norm = check_prefix(prefix)
        return await self._run("list", norm or ".", lambda _: self._keys(norm, True),
                               reading=True, path=self.root)

    async def list_dir(self, prefix: str) -> DirListing:
        norm = check_prefix(prefix)
        return await self._run(
            "list_dir", norm or ".", lambda _: local_listing.dir_level(os, self._top(norm), norm),
            reading=True, path=self.root)

    async def list_incomplete(self, prefix: str) -> Leftovers:
        """Temp files of unfinished writes under ``prefix``, aged by their mtime."""
        norm = check_prefix(prefix)

        def listing(_: str) -> Leftovers:
            now = time.time()
            out = []
            for rel, entry in local_listing.leftovers(os, self._top(norm), norm):
                with contextlib.suppress(FileNotFoundError):
                    out.append(Incomplete(rel, now - entry.stat(follow_symlinks=False).st_mtime))
            return sorted(out)

        return await self._run("list_incomplete", norm or ".", listing, reading=True,
                               path=self.root)

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        """Delete ``.tmp-*`` files of killed writers under ``prefix`` (and the prefix key's
        own temps beside it) whose mtime is at least ``older_than`` seconds old, except
        those under a ``skip`` prefix (live saves)."""
        norm = check_prefix(prefix)

        def cleanup(_: str) -> int:
            now = time.time()
            removed = 0
            for rel, entry in local_listing.leftovers(os, self._top(norm), norm):
                if skipped(rel, skip):
                    continue
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime < older_than:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                removed += 1
                self._prune(os.path.dirname(entry.path))
            return removed

        return await self._run(
            "cleanup_incomplete", norm or ".", cleanup, reading=False, path=self.root
        )

    async def close(self) -> None:
        return None
