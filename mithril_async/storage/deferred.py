"""A blob writer whose key is known only later: the first bytes wait in memory for it.

Why: a save agrees on its version number first (on several ranks a gloo broadcast from rank 0
after rank 0 claimed the number in the store, slower still while a training step holds the
GIL),
and every blob key contains that number.  Encoding does not need the number, so the codec
starts at once and its first output waits here; the agreement and the encoding overlap
instead of adding up.  What waits is bounded (``limit`` bytes): a writer past it waits for the
key, which holds the codec back through the pipeline's in-flight budget.
"""

from __future__ import annotations

import asyncio

from mithril_async.storage.base import BlobWriter, Store, WriterContext

__all__ = ["DeferredWriter"]


class DeferredWriter(WriterContext):
    """:class:`~mithril_async.storage.base.BlobWriter` over ``store.open_writer(await key)``.

    ``key`` is a future (it may be awaited by several writers); its failure fails
    :meth:`write`/:meth:`commit` with the same error.  Bytes written before the key is known
    are held (copied unless they are ``bytes``: the caller may reuse its buffer as soon as
    ``write`` returns, as with every writer), at most ``limit`` of them.  ``key`` (the
    attribute) is the key once the inner writer is open, ``""`` before.
    """

    def __init__(self, store: Store, key: asyncio.Future[str], *, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.key = ""
        self._store = store
        self._key = key
        self._limit = limit
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._inner: BlobWriter | None = None

    async def _open(self) -> BlobWriter:
        if self._inner is None:
            # shielded: a cancelled write must not cancel a key other writers wait for
            key = await asyncio.shield(self._key)
            inner = self._store.open_writer(key)
            self._inner, self.key = inner, key
            held, self._held, self._held_bytes = self._held, [], 0
            for data in held:
                await inner.write(data)
        return self._inner

    async def write(self, data: bytes | memoryview) -> None:
        n = memoryview(data).nbytes
        if self._inner is None and not self._key.done() and self._held_bytes + n <= self._limit:
            # bytes are immutable: held as they are; anything else is copied
            self._held.append(data if isinstance(data, bytes) else bytes(data))
            self._held_bytes += n
            return
        await (await self._open()).write(data)

    async def commit(self) -> int:
        return await (await self._open()).commit()

    async def abort(self) -> None:
        self._held, self._held_bytes = [], 0
        if self._inner is not None:
            await self._inner.abort()
