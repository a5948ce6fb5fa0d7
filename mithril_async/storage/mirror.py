"""A Store that writes every key to a primary (local disk) and a mirror (S3) at once.

Used for ``[checkpointing.remote] mode = "mirror"``: each committed version lives on local disk
and under the bucket prefix with the same keys. Reads prefer the primary and fall back to the
mirror for keys the primary lacks, so ``restore("latest")`` works on a machine that has only
the bucket. Streaming writes are teed into both stores' writers (an S3 multipart upload is fed
while later chunks are still compressing) and committed mirror first, primary second: a version
that is visible locally is always already durable remotely.

Conditional writes are arbitrated by the primary (its ETags); the mirror then receives the same
conditional write where it is a create (``put_if_absent``), or a plain put for alias moves,
because the primary's compare-and-swap has already serialised writers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection

from mithril_async.errors import KeyExists, KeyNotFound
from mithril_async.storage.base import (
    BlobWriter,
    DirListing,
    Leftovers,
    Store,
    WriterContext,
    put_private,
)
from mithril_async.storage.capabilities import HasLocalRoot


class MirrorWriter(WriterContext):
    """Tees writes into the primary's and the mirror's writers; a failure on either side
    aborts both, so a failed write or commit leaves nothing behind on either (as every
    store's writer does), not an open upload or temp file on the side that did not fail."""

    def __init__(self, key: str, writers: list[BlobWriter]) -> None:
        self.key = key
        self._writers = writers

    async def write(self, data: bytes | memoryview) -> None:
        # every side settles before an abort, so no abort races a write still in flight
        results = await asyncio.gather(
            *(w.write(data) for w in self._writers), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.abort()
            raise failed[0]

    async def commit(self) -> int:
        size = 0
        try:
            for w in reversed(self._writers):  # mirror first, primary last
                size = await w.commit()
        except BaseException:
            await self.abort()  # a no-op for a side that committed already
            raise
        return size

    async def abort(self) -> None:
        await asyncio.gather(*(w.abort() for w in self._writers), return_exceptions=True)


class MirrorStore:
    """Primary + mirror; see the module docstring."""

    def __init__(self, primary: Store, mirror: Store) -> None:
        self.primary = primary
        self.mirror = mirror
        self.url = f"{primary.url} + mirror {mirror.url}"
        self.atomic_conditional_writes = primary.atomic_conditional_writes

    @property
    def root(self) -> object:
        return self.primary.root if isinstance(self.primary, HasLocalRoot) else None

    async def get(self, key: str) -> bytes:
        try:
            return await self.primary.get(key)
        except KeyNotFound:
            return await self.mirror.get(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            return await self.primary.get_range(key, start, length)
        except KeyNotFound:
            return await self.mirror.get_range(key, start, length)

    async def size(self, key: str) -> int:
        try:
            return await self.primary.size(key)
        except KeyNotFound:
            return await self.mirror.size(key)

    async def exists(self, key: str) -> bool:
        return await self.primary.exists(key) or await self.mirror.exists(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.mirror.put(key, data)
        await self.primary.put(key, data)

    async def put_private(self, key: str, data: bytes | memoryview) -> None:
        """:meth:`put`, private on each side that can be (see :func:`base.put_private`)."""
        await put_private(self.mirror, key, data)
        await put_private(self.primary, key, data)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        await self.primary.put_if_absent(key, data)
        await self.mirror.put(key, data)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        try:
            return await self.primary.get_with_etag(key)
        except KeyNotFound:
            data = await self.mirror.get(key)
            with contextlib.suppress(KeyExists):  # a concurrent reader adopted it first
                await self.primary.put_if_absent(key, data)  # adopt the mirror's copy locally
            return await self.primary.get_with_etag(key)

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        tag = await self.primary.put_if_match(key, data, etag)
        await self.mirror.put(key, data)
        return tag

    async def list(self, prefix: str) -> list[str]:
        a, b = await asyncio.gather(self.primary.list(prefix), self.mirror.list(prefix))
        return sorted(set(a) | set(b))

    async def list_dir(self, prefix: str) -> DirListing:
        a, b = await asyncio.gather(self.primary.list_dir(prefix), self.mirror.list_dir(prefix))
        return DirListing(sorted({*a.files, *b.files}), sorted({*a.dirs, *b.dirs}))

    async def delete(self, key: str) -> None:
        await self.primary.delete(key)
        await self.mirror.delete(key)

    def open_writer(self, key: str) -> BlobWriter:
        return MirrorWriter(key, [self.primary.open_writer(key), self.mirror.open_writer(key)])

    async def list_incomplete(self, prefix: str) -> Leftovers:
        a, b = await asyncio.gather(self.primary.list_incomplete(prefix),
                                    self.mirror.list_incomplete(prefix))
        return sorted([*a, *b])

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        a, b = await asyncio.gather(
            self.primary.cleanup_incomplete(prefix, older_than, skip=skip),
            self.mirror.cleanup_incomplete(prefix, older_than, skip=skip))
        return a + b

    async def close(self) -> None:
        await asyncio.gather(self.primary.close(), self.mirror.close())
