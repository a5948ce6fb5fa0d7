"""The node-local tier as the manager's store: a node folder, plus what the tier layer lends it.

:class:`NodeStore` wraps the :class:`~mithril_async.storage.local.LocalStore` of this node's
folder and forwards every operation to it, with two additions the save and the restore need:

- ``reported``: the sizes of the blobs that ranks on *other* nodes reported durable in the save
  being committed. Rank 0's pre-commit check asks its store for every blob's size, and those
  blobs lie on other nodes' disks; the tier coordinator fills this during the commit and clears
  it after the verdict.
- ``overlay``: while a recovery restores, the files this node's folder lacks, served from where
  the recovery found them (bytes a peer or the remote sent, kept in memory instead of being
  written and read back; or the store of this node's replica folder). Only reads consult it.

It declares what it can do through the optional store protocols
(:mod:`mithril_async.storage.capabilities`): it has a local root (recorded in ``run.json``),
writes private files, and opens ranged readers for the files that lie in the folder itself; a
file served from the overlay gets no ranged reader (None), so the reader uses
:meth:`get_range`, which serves it.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from mithril_async.errors import KeyNotFound
from mithril_async.storage.base import (
    BlobWriter,
    DirListing,
    Leftovers,
    Store,
    check_range,
)
from mithril_async.storage.capabilities import RangeReader
from mithril_async.storage.local import LocalStore

#: where the overlay serves a file from: its bytes, or a store holding it under the same key
Lent = bytes | memoryview | Store


class NodeStore:
    """This node's folder (``local``) with the commit's reported sizes and a restore's overlay."""

    atomic_conditional_writes = True

    def __init__(self, local: LocalStore) -> None:
        self.local = local
        self.url = local.url
        #: key -> size of a blob another node's rank reported durable in the commit underway
        self.reported: dict[str, int] = {}
        #: key -> where a restore reads a file this folder lacks (see the module docstring)
        self.overlay: dict[str, Lent] = {}

    @property
    def root(self) -> Path:
        """The node folder (:class:`~mithril_async.storage.capabilities.HasLocalRoot`)."""
        return Path(self.local.root)

    # -- reads: the overlay first -----------------------------------------------------------
    async def get(self, key: str) -> bytes:
        src = self.overlay.get(key)
        if src is None:
            return await self.local.get(key)
        if isinstance(src, (bytes, memoryview)):
            return bytes(src)
        return await src.get(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        src = self.overlay.get(key)
        if src is None:
            return await self.local.get_range(key, start, length)
        if isinstance(src, (bytes, memoryview)):
            check_range(key, start, length)
            return bytes(src[start:start + length])
        return await src.get_range(key, start, length)

    async def open_range_reader(self, key: str) -> RangeReader | None:
        """A ranged reader of a file in the folder itself; None for one the overlay serves
        (the caller then reads through :meth:`get_range`)."""
        if key in self.overlay:
            return None
        return await self.local.open_range_reader(key)

    async def size(self, key: str) -> int:
        src = self.overlay.get(key)
        if src is not None:
            return len(src) if isinstance(src, (bytes, memoryview)) else await src.size(key)
        try:
            return await self.local.size(key)
        except KeyNotFound:
            if key in self.reported:
                return self.reported[key]
            raise

    async def exists(self, key: str) -> bool:
        return key in self.overlay or await self.local.exists(key)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return await self.local.get_with_etag(key)

    # -- everything else: the node folder ---------------------------------------------------
    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.local.put(key, data)

    async def put_private(self, key: str, data: bytes | memoryview) -> None:
        await self.local.put_private(key, data)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        await self.local.put_if_absent(key, data)

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        return await self.local.put_if_match(key, data, etag)

    async def list(self, prefix: str) -> list[str]:
        return await self.local.list(prefix)

    async def list_dir(self, prefix: str) -> DirListing:
        return await self.local.list_dir(prefix)

    async def delete(self, key: str) -> None:
        await self.local.delete(key)

    def open_writer(self, key: str) -> BlobWriter:
        return self.local.open_writer(key)

    async def list_incomplete(self, prefix: str) -> Leftovers:
        return await self.local.list_incomplete(prefix)

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        return await self.local.cleanup_incomplete(prefix, older_than, skip=skip)

    async def close(self) -> None:
        await self.local.close()
