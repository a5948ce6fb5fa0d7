"""Reads of an :class:`~mithril_async.storage.s3.S3Store`: ``get``, ``get_range`` and
``get_with_etag`` split a large read into part-sized ranged GETs run concurrently, a HEAD beside
the first range giving the size at once; every range is pinned to one ETag (``IfMatch``), so a
concurrent overwrite restarts the read instead of mixing versions.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mithril_async.errors import KeyNotFound, StorageError
from mithril_async.storage.base import check_range
from mithril_async.storage.s3.connection import S3Connection
from mithril_async.storage.s3.errors import error_code, is_precondition
from mithril_async.storage.s3.writer import MIB

log = logging.getLogger("mithril_async.storage.s3")
T = TypeVar("T")

#: parallel reads: ranges per connection (see ``S3Reads._read_once``) and the largest range
RANGES_PER_CONNECTION = 4
MAX_RANGE = 128 * MIB


def range_size(remaining: int, part: int, connections: int) -> int:
    """Bytes per ranged GET for ``remaining`` bytes: about ``RANGES_PER_CONNECTION`` ranges
    per connection, a whole number of parts (at least one), at most ``MAX_RANGE``."""
    want = -(-remaining // (RANGES_PER_CONNECTION * max(1, connections)))
    return max(part, min(MAX_RANGE, -(-want // part) * part))


class S3Reads(S3Connection):
    """Whole, ranged and size reads of objects, parallel and pinned to one ETag."""

    # -- reads -----------------------------------------------------------------------------
    async def _get_once(
        self, op: str, key: str, start: int | None, end: int | None, if_match: str | None
    ) -> tuple[bytes, dict[str, Any]]:
        """One (ranged) GET with its body fully read; ``end`` is inclusive."""
        kwargs: dict[str, Any] = {"Key": self.full_key(key)}
        if start is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end}"
        if if_match is not None:
            kwargs["IfMatch"] = if_match

        async def attempt() -> tuple[bytes, dict[str, Any]]:
            resp = await self.call(op, key, "get_object", **kwargs)
            async with resp["Body"] as body:
                data = await body.read()
            return data, resp

        return await self._retry_stream(op, key, attempt)

    async def _first_range(self, op: str, key: str, start: int, n: int) -> tuple[bytes, str]:
        """GET ``n`` bytes from ``start``; past the end (or on an empty object) that is
        ``b""`` - after a HEAD, so a missing key still raises :class:`KeyNotFound`."""
        try:
            data, resp = await self._get_once(op, key, start, start + n - 1, None)
        except StorageError as exc:
            if error_code(exc.__cause__ or exc)[0] != "InvalidRange":
                raise
            resp = await self.call(op, key, "head_object", Key=self.full_key(key))
            return b"", str(resp.get("ETag", ""))
        return data, str(resp.get("ETag", ""))

    async def _read(self, op: str, key: str, start: int, length: int | None) -> tuple[bytes, str]:
        """Read ``length`` bytes (``None``: to the end) from ``start``; returns (data, etag)."""
        for _attempt in range(self.max_attempts):
            result = await self._read_once(op, key, start, length)
            if result is not None:
                return result
            log.debug("%s changed during a parallel read; restarting", self.where(key))
        raise StorageError(
            errno.EAGAIN, f"{op}: object kept changing during the read", self.where(key)
        )

    async def _read_once(
        self, op: str, key: str, start: int, length: int | None
    ) -> tuple[bytes, str] | None:
        """One try of :meth:`_read`; ``None`` when the object was replaced meanwhile.

        The first part-sized range is fetched at once. When the read may span more than one
        range, a HEAD runs beside it: its size lets the remaining ranges start without
        waiting for the first one, and its ETag pins them (``IfMatch``) to one version.
        The rest is cut into about ``RANGES_PER_CONNECTION`` ranges per connection (at least
        a part, at most ``MAX_RANGE``): each request has a fixed cost (latency, a request fee;
        on moto a copy of the whole object, so small ranges of a big object crawl), while
        several ranges per connection keep one slow range from holding up the others.
        """
        chunk = self.part_size
        first_len = chunk if length is None else min(chunk, length)
        # every request of this read, the first range and the HEAD included, takes a slot
        sem = asyncio.Semaphore(self.max_concurrency)

        async def limited(request: Callable[[], Awaitable[T]]) -> T:
            async with sem:  # the coroutine is made only here: a cancelled task leaves none
                return await request()

        first = asyncio.ensure_future(
            limited(lambda: self._first_range(op, key, start, first_len))
        )
        tasks: list[asyncio.Future[Any]] = [first]
        try:
            if length is not None and length <= chunk:
                return await first
            head = asyncio.ensure_future(
                limited(lambda: self.call(op, key, "head_object", Key=self.full_key(key)))
            )
            tasks.append(head)
            try:
                meta = await head
            except StorageError:
                # a HEAD error has no body (404 could be NoSuchKey or NoSuchBucket): report
                # the GET's precise error where there is one
                await first
                raise
            etag, total = str(meta.get("ETag", "")), int(meta["ContentLength"])
            stop = total if length is None else min(total, start + length)
            if start >= stop:
                return b"", etag
            step = range_size(stop - start - first_len, chunk, self.max_concurrency)

            async def fetch(off: int) -> bytes:
                async with sem:
                    data, _ = await self._get_once(op, key, off, min(off + step, stop) - 1, etag)
                    return data

            rest = [asyncio.ensure_future(fetch(o)) for o in range(start + first_len, stop, step)]
            tasks += rest
            data, first_etag = await first
            if first_etag != etag:
                return None
            pieces = [data, *await asyncio.gather(*rest)]
        except StorageError as exc:
            if is_precondition(exc.__cause__ or exc):
                return None
            raise
        finally:  # on any exit stop what is still running and collect every outcome
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if stop - start > 4 * chunk:  # a big memcpy: keep it off the event loop
            return await asyncio.to_thread(b"".join, pieces), etag
        return b"".join(pieces), etag

    async def get(self, key: str) -> bytes:
        return (await self._read("get", key, 0, None))[0]

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return await self._read("get_with_etag", key, 0, None)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        if length == 0:
            await self.size(key)  # still report a missing key
            return b""
        return (await self._read("get_range", key, start, length))[0]

    async def size(self, key: str) -> int:
        resp = await self.call("size", key, "head_object", Key=self.full_key(key))
        return int(resp["ContentLength"])

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except KeyNotFound:
            return False
        return True
