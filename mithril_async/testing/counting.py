"""A store that counts what is asked of it: requests by kind, by key prefix and by rank.

:class:`CountingStore` wraps any :class:`~mithril_async.storage.base.Store` and records every
request it forwards (:class:`RequestLog`): its kind (``get``, ``put``, ``list``, ...), the
key prefix it falls under (the key's folder, S3's unit of request-rate partitioning; for a
listing, the folder listed), the rank that made it (:meth:`CountingStore.view` gives each
simulated rank a view that tags its requests), how many keys each listing returned, and the
bytes each rank wrote under each prefix. A blob written through ``open_writer`` counts as S3's
streaming writer sends it: a single PUT under one part (``part_bytes``), else a create, one
request per part and a complete.

From the bytes, :meth:`RequestLog.modelled_write_rate` says how many write requests per
second each prefix would receive if every rank wrote its share at ``rank_bytes_per_s`` in
parts of ``part_bytes``: what a save of tiny tensors would cost S3 at full size.

Optionally it models S3 itself: ``latency_s`` added to every request, at most
``max_inflight`` requests at once per view (as an S3 client's connection pool), and per
prefix rate limits (``write_rate`` / ``read_rate`` requests per second: S3 serves about
3,500 writes and 5,500 reads per second per prefix), enforced by queueing each request behind
the prefix's earlier ones, as a client retrying ``SlowDown`` would wait.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from mithril_async.storage.base import BlobWriter, DirListing, Leftovers, Store
from mithril_async.storage.capabilities import SizedListing

__all__ = ["READS", "WRITES", "CountingStore", "RequestLog", "prefix_of"]

#: request kinds S3 counts against a prefix's write limit (PUT, POST, DELETE, multipart)
WRITES = frozenset({"put", "put_if_absent", "put_if_match", "delete", "upload_create",
                    "upload_part", "upload_complete", "upload_abort", "cleanup_incomplete"})
#: request kinds S3 counts against a prefix's read limit (GET, HEAD, LIST)
READS = frozenset({"get", "get_range", "size", "exists", "get_with_etag", "list",
                   "list_dir", "list_incomplete"})


_KEY_READS = frozenset({"get", "get_range", "size", "exists", "get_with_etag"})


def prefix_of(key: str) -> str:
    """The folder a key lies in (its prefix up to the last ``/``)."""
    return key.rsplit("/", 1)[0] if "/" in key else ""


@dataclass
class RequestLog:
    """What a :class:`CountingStore` and its views were asked (shared by all views)."""

    by_kind: Counter[str] = field(default_factory=Counter)
    by_prefix: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_rank: Counter[tuple[int | None, str]] = field(default_factory=Counter)
    #: keys returned by each ``list`` / entries by each ``list_dir``: (kind, prefix, count)
    listings: list[tuple[str, str, int]] = field(default_factory=list)
    #: bytes written, by (prefix, rank)
    written: Counter[tuple[str, int | None]] = field(default_factory=Counter)
    #: bytes of each streaming write, by key
    uploads: dict[str, int] = field(default_factory=dict)
    #: every key read (get, get_range, size, exists, get_with_etag)
    read_keys: set[str] = field(default_factory=set)

    def record(self, kind: str, prefix: str, rank: int | None, n: int = 1) -> None:
        self.by_kind[kind] += n
        self.by_prefix[prefix, kind] += n
        self.by_rank[rank, kind] += n

    def clear(self) -> None:
        """Forget everything (between two measured operations)."""
        for c in (self.by_kind, self.by_prefix, self.by_rank, self.written):
            c.clear()
        self.listings.clear()
        self.uploads.clear()
        self.read_keys.clear()

    def total(self, kinds: Collection[str] | None = None) -> int:
        return sum(n for k, n in self.by_kind.items() if kinds is None or k in kinds)

    def of_rank(self, rank: int | None, kinds: Collection[str] | None = None) -> int:
        return sum(n for (r, k), n in self.by_rank.items()
                   if r == rank and (kinds is None or k in kinds))

    def per_prefix(self, kinds: Collection[str]) -> Counter[str]:
        """Requests of ``kinds`` by prefix."""
        out: Counter[str] = Counter()
        for (p, k), n in self.by_prefix.items():
            if k in kinds:
                out[p] += n
        return out

    def busiest(self, kinds: Collection[str]) -> tuple[str, int]:
        """The prefix that received the most requests of ``kinds``, and how many."""
        counts = self.per_prefix(kinds)
        return counts.most_common(1)[0] if counts else ("", 0)

    def listed_keys(self) -> int:
        """Keys (and folder entries) returned by every listing together."""
        return sum(n for _, _, n in self.listings)

    def modelled_write_rate(self, part_bytes: int, rank_bytes_per_s: float
                            ) -> dict[str, float]:
        """Write requests per second per prefix if each rank wrote all its bytes at
        ``rank_bytes_per_s`` in parts of ``part_bytes``, all ranks at once: a prefix gets
        each rank's part rate in proportion to the share of that rank's bytes written there."""
        per_rank: Counter[int | None] = Counter()
        for (_, rank), n in self.written.items():
            per_rank[rank] += n
        parts_per_s = rank_bytes_per_s / part_bytes
        out: dict[str, float] = defaultdict(float)
        for (prefix, rank), n in self.written.items():
            if per_rank[rank]:
                out[prefix] += parts_per_s * n / per_rank[rank]
        return dict(out)


class _Limits:
    """The optional S3 model shared by the views: per prefix, when the next request of
    each class may start."""

    def __init__(self, latency_s: float, write_rate: float | None,
                 read_rate: float | None) -> None:
        self.latency_s = latency_s
        self.rates = {"write": write_rate, "read": read_rate}
        self.next_free: dict[tuple[str, str], float] = {}

    async def wait(self, kind: str, prefix: str) -> None:
        cls = "write" if kind in WRITES else "read"
        rate = self.rates[cls]
        delay = self.latency_s
        if rate:
            now = time.monotonic()
            start = max(now, self.next_free.get((prefix, cls), now))
            self.next_free[prefix, cls] = start + 1.0 / rate
            delay += start - now
        if delay > 0:
            await asyncio.sleep(delay)


class _CountingWriter:
    """A streaming writer counted as S3's writer uploads: a blob under one part is a single
    PUT at commit; a larger one a create, a part per ``part_bytes`` written and a complete."""

    def __init__(self, store: CountingStore, inner: BlobWriter) -> None:
        self.key = inner.key
        self._store = store
        self._inner = inner
        self._size = 0
        self._parts = 0

    async def write(self, data: bytes | memoryview) -> None:
        await self.account(len(data))
        await self._inner.write(data)

    async def account(self, nbytes: int) -> None:
        """Count ``nbytes`` more written: a part request for every part filled."""
        self._size += nbytes
        self._store.log.written[prefix_of(self.key), self._store.rank] += nbytes
        part = self._store.part_bytes
        while self._size - self._parts * part >= part:
            if self._parts == 0:
                await self._store._request("upload_create", self.key)
            self._parts += 1
            await self._store._request("upload_part", self.key)

    async def commit(self) -> int:
        if self._parts == 0:
            await self._store._request("put", self.key)
        else:
            if self._size > self._parts * self._store.part_bytes:
                self._parts += 1
                await self._store._request("upload_part", self.key)
            await self._store._request("upload_complete", self.key)
        self._store.log.uploads[self.key] = self._size
        return await self._inner.commit()

    async def abort(self) -> None:
        if self._parts:
            await self._store._request("upload_abort", self.key)
        await self._inner.abort()

    async def __aenter__(self) -> _CountingWriter:
        return self

    async def __aexit__(self, et: object, e: object, tb: object) -> None:
        if et is None:
            await self.commit()
        else:
            await self.abort()


class _NullWriter:
    """The inner writer of a stand-in upload: the bytes go in with one ``put``."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def write(self, data: bytes | memoryview) -> None:
        return None

    async def commit(self) -> int:
        return 0

    async def abort(self) -> None:
        return None


class CountingStore:
    """``inner`` with every request counted (module docstring). ``rank`` tags this view's
    requests; :meth:`view` makes another view over the same store and log."""

    def __init__(self, inner: Store, *, rank: int | None = None, latency_s: float = 0.0,
                 max_inflight: int | None = None, write_rate: float | None = None,
                 read_rate: float | None = None, part_bytes: int = 8 << 20,
                 log: RequestLog | None = None, _limits: _Limits | None = None) -> None:
        self.inner = inner
        #: the multipart part size streaming writes are counted in
        self.part_bytes = part_bytes
        self.url = f"counting+{inner.url}"
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.rank = rank
        self.log = log if log is not None else RequestLog()
        self._limits = _limits or _Limits(latency_s, write_rate, read_rate)
        self._max_inflight = max_inflight
        self._slots = asyncio.Semaphore(max_inflight) if max_inflight else None

    def view(self, rank: int | None) -> CountingStore:
        """The same store and log, its requests tagged with ``rank`` (and limited to
        ``max_inflight`` at once of its own)."""
        return CountingStore(self.inner, rank=rank, log=self.log, _limits=self._limits,
                             max_inflight=self._max_inflight, part_bytes=self.part_bytes)

    async def stand_in_upload(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` (the very object: no copy) counted as a streaming
        write of it would be: for a caller standing in for a rank that writes the same
        bytes as another (a replayed rank)."""
        writer = _CountingWriter(self, _NullWriter(key))
        await writer.account(len(data))
        await writer.commit()
        await self.inner.put(key, data)

    async def request(self, kind: str, key: str, *, folder: bool = False) -> None:
        """Count (and, with the S3 model, delay) one request of ``kind`` on ``key``, for a
        caller that stands in for a request it does not make (a replayed upload)."""
        await self._request(kind, key, folder=folder)

    async def _request(self, kind: str, key: str, *, folder: bool = False) -> None:
        prefix = key.rstrip("/") if folder else prefix_of(key)
        self.log.record(kind, prefix, self.rank)
        if kind in _KEY_READS:
            self.log.read_keys.add(key)
        if self._slots is None:
            await self._limits.wait(kind, prefix)
            return
        async with self._slots:
            await self._limits.wait(kind, prefix)

    # ---------------------------------------------------------------- Store protocol
    async def get(self, key: str) -> bytes:
        await self._request("get", key)
        return await self.inner.get(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        await self._request("get_range", key)
        return await self.inner.get_range(key, start, length)

    async def size(self, key: str) -> int:
        await self._request("size", key)
        return await self.inner.size(key)

    async def exists(self, key: str) -> bool:
        await self._request("exists", key)
        return await self.inner.exists(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._request("put", key)
        self.log.written[prefix_of(key), self.rank] += len(data)
        await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        await self._request("put_if_absent", key)
        self.log.written[prefix_of(key), self.rank] += len(data)
        await self.inner.put_if_absent(key, data)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        await self._request("get_with_etag", key)
        return await self.inner.get_with_etag(key)

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        await self._request("put_if_match", key)
        self.log.written[prefix_of(key), self.rank] += len(data)
        return await self.inner.put_if_match(key, data, etag)

    async def list(self, prefix: str) -> list[str]:
        await self._request("list", prefix, folder=True)
        keys = await self.inner.list(prefix)
        self.log.listings.append(("list", prefix.rstrip("/"), len(keys)))
        return keys

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """The inner store's sized listing (counted as one listing), or, for a store
        without one, a listing and a size request per key."""
        if not isinstance(self.inner, SizedListing):
            return {k: await self.size(k) for k in await self.list(prefix)}
        await self._request("list", prefix, folder=True)
        got = await self.inner.list_sizes(prefix)
        self.log.listings.append(("list", prefix.rstrip("/"), len(got)))
        return got

    async def list_dir(self, prefix: str) -> DirListing:
        await self._request("list_dir", prefix, folder=True)
        got = await self.inner.list_dir(prefix)
        self.log.listings.append(("list_dir", prefix.rstrip("/"),
                                  len(got.files) + len(got.dirs)))
        return got

    async def delete(self, key: str) -> None:
        await self._request("delete", key)
        await self.inner.delete(key)

    def open_writer(self, key: str) -> _CountingWriter:
        return _CountingWriter(self, self.inner.open_writer(key))

    async def list_incomplete(self, prefix: str) -> Leftovers:
        await self._request("list_incomplete", prefix, folder=True)
        return await self.inner.list_incomplete(prefix)

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        await self._request("cleanup_incomplete", prefix, folder=True)
        return await self.inner.cleanup_incomplete(prefix, older_than, skip=skip)

    async def close(self) -> None:
        return None
