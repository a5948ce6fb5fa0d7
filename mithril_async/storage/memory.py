"""An in-memory Store with the same semantics as the durable ones.

Used by unit tests and the fault-injection suite: it is fast, needs no disk, and can be told
to fail a given operation (:meth:`MemoryStore.inject_fault`) so error paths are testable
without a real broken disk. Every call yields to the event loop once, so concurrent tasks
interleave the way they would against a real backend.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import Collection

from mithril_async.errors import KeyExists, KeyNotFound, PreconditionFailed, StorageError
from mithril_async.storage.base import (
    DirListing,
    Incomplete,
    Leftovers,
    WriterContext,
    as_bytes,
    check_key,
    check_prefix,
    check_range,
    dir_listing,
    key_in_prefix,
    skipped,
)

_etags = itertools.count(1)


class MemoryWriter(WriterContext):
    """Buffers writes; :meth:`commit` publishes them atomically under the key."""

    def __init__(self, store: MemoryStore, key: str) -> None:
        self.key = key
        self._store = store
        self._chunks: list[bytes] = []
        self._done = False
        self.started = time.time()

    async def write(self, data: bytes | memoryview) -> None:
        if self._done:
            raise StorageError(f"write to a finished writer for {self._store.url}{self.key}")
        await self._store._step("write", self.key)
        self._chunks.append(as_bytes(data))

    async def commit(self) -> int:
        if self._done:
            raise StorageError(f"commit of a finished writer for {self._store.url}{self.key}")
        try:
            await self._store._step("commit", self.key)
        except BaseException:
            await self.abort()
            raise
        data = b"".join(self._chunks)
        self._store._set(self.key, data)
        self._finish()
        return len(data)

    async def abort(self) -> None:
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._chunks = []
        self._store._incomplete.discard(self)


class MemoryStore:
    """Dict-backed store; etags are a global counter so ABA writes still change the tag."""

    atomic_conditional_writes = True

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._data: dict[str, tuple[bytes, str]] = {}
        self._incomplete: set[MemoryWriter] = set()
        self._faults: dict[str, list[BaseException]] = defaultdict(list)

    # -- fault injection -------------------------------------------------------------------
    def inject_fault(self, op: str, exc: BaseException, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` raise ``exc``.

        ``op`` is a method name (``get``, ``put``, ``put_if_match``, ...) or ``write`` /
        ``commit`` for streaming writers, or ``*`` for any operation.
        """
        self._faults[op].extend([exc] * times)

    async def _step(self, op: str, key: str) -> None:
        await asyncio.sleep(0)
        for name in (op, "*"):
            if self._faults.get(name):
                raise self._faults[name].pop(0)

    # -- helpers ---------------------------------------------------------------------------
    def _set(self, key: str, data: bytes) -> str:
        etag = f"m{next(_etags)}"
        self._data[key] = (data, etag)
        return etag

    def _lookup(self, key: str) -> tuple[bytes, str]:
        try:
            return self._data[key]
        except KeyError:
            raise KeyNotFound(f"key not found: {self.url}{key}") from None

    # -- Store protocol --------------------------------------------------------------------
    async def get(self, key: str) -> bytes:
        check_key(key)
        await self._step("get", key)
        return self._lookup(key)[0]

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        check_key(key)
        check_range(key, start, length)
        await self._step("get_range", key)
        return self._lookup(key)[0][start : start + length]

    async def size(self, key: str) -> int:
        check_key(key)
        await self._step("size", key)
        return len(self._lookup(key)[0])

    async def exists(self, key: str) -> bool:
        check_key(key)
        await self._step("exists", key)
        return key in self._data

    async def put(self, key: str, data: bytes | memoryview) -> None:
        check_key(key)
        payload = as_bytes(data)
        await self._step("put", key)
        self._set(key, payload)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        check_key(key)
        payload = as_bytes(data)
        await self._step("put_if_absent", key)
        if key in self._data:
            raise KeyExists(f"key already exists: {self.url}{key}")
        self._set(key, payload)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        check_key(key)
        await self._step("get_with_etag", key)
        return self._lookup(key)

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        check_key(key)
        payload = as_bytes(data)
        await self._step("put_if_match", key)
        current = self._data.get(key)
        if (current[1] if current else None) != etag:
            raise PreconditionFailed(
                f"conditional write of {self.url}{key} lost: expected etag {etag!r}, "
                f"found {current[1] if current else None!r}"
            )
        return self._set(key, payload)

    async def list(self, prefix: str) -> list[str]:
        norm = check_prefix(prefix)
        await self._step("list", norm)
        return sorted(k for k in self._data if key_in_prefix(k, norm))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` with its size (:class:`~mithril_async.storage.
        capabilities.SizedListing`)."""
        norm = check_prefix(prefix)
        await self._step("list_sizes", norm)
        return dict(sorted((k, len(v[0])) for k, v in self._data.items()
                           if key_in_prefix(k, norm)))

    async def list_dir(self, prefix: str) -> DirListing:
        norm = check_prefix(prefix)
        await self._step("list_dir", norm)
        head = f"{norm}/" if norm else ""
        return dir_listing(k[len(head) :] for k in self._data if k.startswith(head))

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._step("delete", key)
        self._data.pop(key, None)

    def open_writer(self, key: str) -> MemoryWriter:
        check_key(key)
        writer = MemoryWriter(self, key)
        self._incomplete.add(writer)
        return writer

    async def list_incomplete(self, prefix: str) -> Leftovers:
        """Writers opened but never committed/aborted under ``prefix``, aged by their start."""
        norm = check_prefix(prefix)
        await self._step("list_incomplete", norm)
        now = time.time()
        return sorted(Incomplete(w.key, now - w.started) for w in self._incomplete
                      if key_in_prefix(w.key, norm))

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        """Abort writers that were opened but never committed/aborted (simulated orphans),
        except those under a ``skip`` prefix."""
        norm = check_prefix(prefix)
        await self._step("cleanup_incomplete", norm)
        now = time.time()
        stale = [
            w
            for w in self._incomplete
            if key_in_prefix(w.key, norm) and now - w.started >= older_than
            and not skipped(w.key, skip)
        ]
        for w in stale:
            await w.abort()
        return len(stale)

    async def close(self) -> None:
        return None
