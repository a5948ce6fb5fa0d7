"""A Store on the local file system: temp file + fsync + rename, never a torn file.

The steps are the pieces of :mod:`mithril_async.storage.atomic`, called with this module's
``os`` (``fs=os``), so every system call of a save goes through one name that the fault and
power-loss tests replace.

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
import builtins
import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TypeVar

from mithril_async.errors import (
    KeyExists,
    KeyNotFound,
    LockTimeout,
    PreconditionFailed,
    StorageError,
    UnsafeKey,
)
from mithril_async.storage.atomic import create_temp, fsync_dir, unlink_quiet, write_all
from mithril_async.storage.base import (
    RESERVED_PREFIX,
    DirListing,
    Incomplete,
    Leftovers,
    WriterContext,
    check_key,
    check_prefix,
    check_range,
    child_name,
    key_in_prefix,
    skipped,
)

T = TypeVar("T")

LOCK_NAME = RESERVED_PREFIX + "cas.lock"
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
_WRITE_BUFFER = 1 << 20  # small writes are coalesced up to this size before a thread hop
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
#: permissions of a store's files (before the umask), and of the private ones
FILE_MODE = 0o644
PRIVATE_MODE = 0o600
#: how long ``put_if_match`` waits for the compare-and-swap lock by default, and the longest
#: pause between two tries (polling with backoff: ``flock`` itself cannot time out)
LOCK_TIMEOUT_S = 60.0
_LOCK_MAX_PAUSE_S = 0.1


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
        self, op: str, key: str, fn: Callable[[str], T], *, reading: bool, path: str | None = None
    ) -> T:
        p = self._path(key) if path is None else path

        def confined() -> T:
            if path is None:
                self._confine(p)
            return fn(p)

        # A cancelled caller waits for the worker thread: the thread cannot be stopped, so
        # the operation's effect (a claim linked, a file renamed) is settled before the
        # CancelledError propagates and the caller's cleanup can see and undo it.
        task = asyncio.ensure_future(asyncio.to_thread(confined))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # retrieved: the cancel is what the caller sees
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

    @contextlib.contextmanager
    def _cas_lock(self) -> Iterator[None]:
        """Hold the store's compare-and-swap lock (an ``flock`` on ``.tmp-cas.lock``).

        The file is created 0600 and never followed through a symlink: whoever can open it
        can take the lock, so only the store's owner may. A lock file left group- or
        world-accessible by an older version is tightened when it is ours."""
        path = os.path.join(self.root, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, PRIVATE_MODE)
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o077 and st.st_uid == os.geteuid():
                os.fchmod(fd, PRIVATE_MODE)
            self._lock(fd, path)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _lock(self, fd: int, path: str) -> None:
        """``flock`` ``fd`` exclusively within ``lock_timeout_s`` (non-blocking tries with a
        growing pause), else :class:`LockTimeout`: a holder that never lets go must fail the
        write that waits for it, not hang it and every later save."""
        deadline = time.monotonic() + self.lock_timeout_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout(errno.ETIMEDOUT, f"the lock {path} of {self.url} stayed held "
                                  f"by another process for {self.lock_timeout_s:g} s", path)
            time.sleep(min(pause, left))
            pause = min(pause * 2, _LOCK_MAX_PAUSE_S)

    # -- reads -----------------------------------------------------------------------------
    @staticmethod
    def _read(path: str) -> bytes:
        with open(_open_file(path), "rb", buffering=0, closefd=True) as f:
            return f.read()

    async def get(self, key: str) -> bytes:
        return await self._run("get", key, self._read, reading=True)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)

        def read_range(path: str) -> bytes:
            fd = _open_file(path)
            try:
                return _pread(fd, start, length)
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
        fd = await self._run("get_range", key, _open_file, reading=True)
        return LocalRangeReader(self, key, path, fd)

    async def size(self, key: str) -> int:
        def stat_size(path: str) -> int:
            st = os.stat(path, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, "symlink", path)
            _check_regular(st.st_mode, path)
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
    def _walk(self, top: str, rel: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Yield (key, entry) of regular files and reserved temp files below ``top``."""
        try:
            it = os.scandir(top)
        except (FileNotFoundError, NotADirectoryError):
            return
        with it:
            for entry in it:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(entry.path, key)
                elif entry.is_file(follow_symlinks=False):
                    yield key, entry

    def _keys(self, top: str, rel: str) -> Iterator[str]:
        """Yield the keys of the regular files below ``top`` (whose key is ``rel``), skipping
        temp/lock files and names no key can have."""
        for key, _entry in self._walk(top, rel):
            try:
                yield check_key(key)
            except UnsafeKey:
                continue

    def _listing(self, norm: str, sized: bool) -> dict[str, int]:
        """The keys under the normalised prefix ``norm``, sorted, from one walk (on a worker
        thread), each with its size where ``sized`` (else 0: nothing is stat'ed)."""
        self._check_prefix_dir(norm)
        top = os.path.join(self.root, norm) if norm else self.root
        out: dict[str, int] = {}
        if norm and os.path.isfile(top) and not os.path.islink(top):
            out[norm] = os.stat(top, follow_symlinks=False).st_size if sized else 0
        for key, entry in self._walk(top, norm):
            try:
                out[check_key(key)] = entry.stat(follow_symlinks=False).st_size if sized else 0
            except (UnsafeKey, FileNotFoundError):
                continue
        return {k: out[k] for k in sorted(out) if key_in_prefix(k, norm)}

    async def list(self, prefix: str) -> list[str]:
        norm = check_prefix(prefix)
        return list(await self._run("list", norm or ".", lambda _: self._listing(norm, False),
                                    reading=True, path=self.root))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` with its size, from one directory walk
        (:class:`~mithril_async.storage.capabilities.SizedListing`)."""
        norm = check_prefix(prefix)
        return await self._run("list", norm or ".", lambda _: self._listing(norm, True),
                               reading=True, path=self.root)

    async def list_dir(self, prefix: str) -> DirListing:
        norm = check_prefix(prefix)

        def list_level(_: str) -> DirListing:
            self._check_prefix_dir(norm)
            top = os.path.join(self.root, norm) if norm else self.root
            files: list[str] = []
            dirs: list[str] = []
            try:
                it = os.scandir(top)
            except (FileNotFoundError, NotADirectoryError):
                return DirListing(files, dirs)
            with it:
                for entry in it:
                    if child_name(entry.name) is None:  # temp/lock files, foreign names
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        # a folder counts only with a key below it, as on S3 (not an empty
                        # directory, nor one holding only a running writer's temp file)
                        rel = f"{norm}/{entry.name}" if norm else entry.name
                        if next(self._keys(entry.path, rel), None) is not None:
                            dirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        files.append(entry.name)
            return DirListing(sorted(files), sorted(dirs))

        return await self._run(
            "list_dir", norm or ".", list_level, reading=True, path=self.root
        )

    def _leftovers(self, norm: str) -> builtins.list[tuple[str, os.DirEntry[str]]]:
        """Worker-thread body: (path below the root, entry) of every temp file of a writer
        under ``norm`` (and of the key ``norm`` itself, which live beside it)."""
        self._check_prefix_dir(norm)
        top = os.path.join(self.root, norm) if norm else self.root
        candidates = list(self._walk(top, norm))
        if norm:  # temps of the key ``norm`` itself live in its parent directory
            parent = os.path.dirname(top)
            own = f"{RESERVED_PREFIX}{os.path.basename(top)[:100]}."
            rel_parent = os.path.dirname(norm)
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                candidates += [(f"{rel_parent}/{e.name}" if rel_parent else e.name, e)
                               for e in os.scandir(parent) if e.name.startswith(own)]
        return [(rel, e) for rel, e in candidates
                if e.name.startswith(RESERVED_PREFIX) and e.name != LOCK_NAME]

    async def list_incomplete(self, prefix: str) -> Leftovers:
        """Temp files of unfinished writes under ``prefix``, aged by their mtime."""
        norm = check_prefix(prefix)

        def listing(_: str) -> Leftovers:
            now = time.time()
            out = []
            for rel, entry in self._leftovers(norm):
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
            for rel, entry in self._leftovers(norm):
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


class NotRegularFile(OSError):
    """A key's path holds something other than a file or folder (a FIFO, a socket, a
    device): never a stored value, so refused (:class:`UnsafeKey` naming the key)."""

    def __init__(self, kind: str, path: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)
        self.kind = kind


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _check_regular(mode: int, path: str) -> None:
    """Refuse what is not a regular file: a folder is no key (KeyNotFound, as a missing
    file), anything else is :class:`NotRegularFile`."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    raise NotRegularFile(kind, path)


def _open_file(path: str) -> int:
    """A blocking read-only descriptor of the regular file at ``path`` (no symlink, no
    folder, no FIFO or device). Opened non-blocking, so a FIFO cannot hang the open; checked
    by ``fstat`` on the descriptor itself (no race with a rename); then made blocking."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        _check_regular(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread(fd: int, start: int, length: int) -> bytes:
    """``length`` bytes at ``start`` of ``fd`` (fewer only at its end)."""
    parts: list[bytes] = []
    pos, left = start, length
    while left > 0:
        chunk = os.pread(fd, left, pos)
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

    def __init__(self, store: LocalStore, key: str, path: str, fd: int) -> None:
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
            return _pread(self._fd, start, length)
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
            os.close(fd)


class LocalWriter(WriterContext):
    """Streams into ``.tmp-<name>.<pid>.<rand>`` beside the target; commit renames it.

    Small writes are coalesced in memory up to 1 MiB; larger ones go straight to the file on a
    worker thread. The caller's buffer is fully written before :meth:`write` returns, so it
    may be reused. A failed write or commit removes the temp file itself.
    """

    def __init__(self, store: LocalStore, key: str, path: str) -> None:
        self.key = key
        self._store = store
        self._path = path
        self._fd: int | None = None
        self._tmp: str | None = None
        self._buf = bytearray()
        self._size = 0
        self._done = False
        self._inflight: asyncio.Future[None] | None = None

    async def _in_thread(self, op: str, fn: Callable[[], None]) -> None:
        if self._done:
            raise StorageError(f"{op} on a finished writer for {self.key!r} in {self._store.url}")
        if self._inflight is not None and not self._inflight.done():
            raise StorageError(f"concurrent {op} on the writer for {self.key!r}")
        fut = asyncio.get_running_loop().run_in_executor(None, fn)
        self._inflight = fut
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self.abort()
            raise
        except OSError as exc:
            self._discard()
            if isinstance(exc, StorageError | UnsafeKey):
                raise
            raise self._store._error(exc, op, self.key, self._tmp or self._path,
                                     reading=False) from exc
        except BaseException:
            self._discard()
            raise

    def _flush(self, extra: bytes | memoryview | None) -> None:
        """Worker-thread body: create the temp on first use, then write buffer + extra."""
        if self._fd is None:
            self._fd, self._tmp = self._store._create_tmp(self._path)
        if self._buf:
            write_all(self._fd, self._buf, fs=os)
            self._buf.clear()
        if extra is not None:
            write_all(self._fd, extra, fs=os)

    async def write(self, data: bytes | memoryview) -> None:
        n = memoryview(data).nbytes
        if self._done:
            raise StorageError(f"write on a finished writer for {self.key!r} in {self._store.url}")
        if len(self._buf) + n <= _WRITE_BUFFER:
            self._buf += data
        else:
            await self._in_thread("write", lambda: self._flush(data))
        self._size += n

    async def commit(self) -> int:
        def commit() -> None:
            self._flush(None)
            assert self._fd is not None and self._tmp is not None
            self._store._fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.rename(self._tmp, self._path)
            self._tmp = None
            self._store._sync_dir(os.path.dirname(self._path))

        await self._in_thread("commit", commit)
        self._done = True
        return self._size

    async def abort(self) -> None:
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([self._inflight])  # let a cancelled write finish first
        self._discard()

    def _discard(self) -> None:
        self._done = True
        self._buf = bytearray()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None
            self._store._prune(os.path.dirname(self._path))

    def __del__(self) -> None:
        """A writer dropped without commit/abort removes its temp file (best effort)."""
        try:
            if self._inflight is None or self._inflight.done():
                self._discard()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
