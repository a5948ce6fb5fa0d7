"""The streaming writer of a :class:`~mithril_async.storage.local.LocalStore`.

A blob is streamed into a temp file beside its key (``.tmp-<name>.<pid>.<rand>``), fsynced and
renamed over the key on commit, so a reader never sees a partial value; a failed, aborted or
dropped writer removes its temp file. Every system call goes through the store's file system
module (``fs``, the store's ``os``), the one name the fault and power-loss tests replace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

from mithril_async.errors import StorageError, UnsafeKey
from mithril_async.storage.atomic import write_all
from mithril_async.storage.base import WriterContext

_WRITE_BUFFER = 1 << 20  # small writes are coalesced up to this size before a thread hop


class WriterHost(Protocol):
    """What a writer needs of its store: where temp files go, how they are made durable,
    and the store's typed errors."""

    url: str

    @property
    def fs(self) -> ModuleType: ...

    def _create_tmp(self, path: str, mode: int = ...) -> tuple[int, str]: ...

    def _fsync(self, fd: int) -> None: ...

    def _sync_dir(self, path: str) -> None: ...

    def _prune(self, d: str) -> None: ...

    def _error(self, exc: OSError, op: str, key: str, path: str, *,
               reading: bool) -> Exception: ...


class LocalWriter(WriterContext):
    """Streams into ``.tmp-<name>.<pid>.<rand>`` beside the target; commit renames it.

    Small writes are coalesced in memory up to 1 MiB; larger ones go straight to the file on a
    worker thread. The caller's buffer is fully written before :meth:`write` returns, so it
    may be reused. A failed write or commit removes the temp file itself.
    """

    def __init__(self, store: WriterHost, key: str, path: str) -> None:
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
            write_all(self._fd, self._buf, fs=self._store.fs)
            self._buf.clear()
        if extra is not None:
            write_all(self._fd, extra, fs=self._store.fs)

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
            fs = self._store.fs
            self._flush(None)
            assert self._fd is not None and self._tmp is not None
            self._store._fsync(self._fd)
            fs.close(self._fd)
            self._fd = None
            fs.rename(self._tmp, self._path)
            self._tmp = None
            self._store._sync_dir(fs.path.dirname(self._path))

        await self._in_thread("commit", commit)
        self._done = True
        return self._size

    async def abort(self) -> None:
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([self._inflight])  # let a cancelled write finish first
        self._discard()

    def _discard(self) -> None:
        fs = self._store.fs
        self._done = True
        self._buf = bytearray()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fs.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                fs.unlink(self._tmp)
            self._tmp = None
            self._store._prune(fs.path.dirname(self._path))

    def __del__(self) -> None:
        """A writer dropped without commit/abort removes its temp file (best effort)."""
        try:
            if self._inflight is None or self._inflight.done():
                self._discard()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
