"""MemoryStore: the conformance suite plus its fault-injection hook."""

from __future__ import annotations

import asyncio
import errno
from dataclasses import dataclass, field

import pytest

from mithril_async.errors import StorageError
from mithril_async.storage.memory import MemoryStore
from mithril_async.testing.store import StoreTests


@dataclass
class MemoryFactory:
    spill_size: int = 0
    knows_upload_age: bool = True
    large_size: int = 5 << 20
    store: MemoryStore = field(default_factory=MemoryStore)

    def new(self) -> MemoryStore:
        """All "writers" share one dict, as processes share one disk."""
        return self.store


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def factory(self) -> MemoryFactory:
        return MemoryFactory()


def test_inject_fault() -> None:
    async def body() -> None:
        s = MemoryStore()
        s.inject_fault("put", StorageError(errno.ENOSPC, "disk full"))
        with pytest.raises(StorageError) as info:
            await s.put("k", b"x")
        assert info.value.errno == errno.ENOSPC
        await s.put("k", b"x")
        s.inject_fault("commit", StorageError(errno.EIO, "io"), times=1)
        w = s.open_writer("w")
        await w.write(b"data")
        with pytest.raises(StorageError):
            await w.commit()
        assert not await s.exists("w")
        assert await s.cleanup_incomplete("") == 0

    asyncio.run(body())
