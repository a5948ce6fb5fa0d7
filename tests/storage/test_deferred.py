"""DeferredWriter: a blob writer whose key arrives later (the version number being agreed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mithril_async.errors import DistributedError
from mithril_async.storage.deferred import DeferredWriter
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore


def test_bytes_wait_for_the_key_then_stream_into_the_store(tmp_path: Path) -> None:
    async def body() -> None:
        store = LocalStore(tmp_path)
        key: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        w = DeferredWriter(store, key, limit=1 << 20)
        buf = bytearray(b"a" * 1000)
        await w.write(buf)
        buf[:] = b"b" * 1000  # the caller reuses its buffer at once: the held copy is kept
        await w.write(memoryview(b"c" * 10))
        assert w.key == "" and list(tmp_path.rglob("*")) == []  # nothing touched the disk
        key.set_result("v/blob.bin")
        await w.write(b"d" * 5)
        assert await w.commit() == 1015
        assert w.key == "v/blob.bin"
        assert await store.get("v/blob.bin") == b"a" * 1000 + b"c" * 10 + b"d" * 5

    asyncio.run(body())


def test_past_the_limit_a_write_waits_for_the_key() -> None:
    async def body() -> None:
        store = MemoryStore()
        key: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        w = DeferredWriter(store, key, limit=100)
        await w.write(b"x" * 60)  # held
        blocked = asyncio.ensure_future(w.write(b"y" * 60))  # 120 > 100: waits
        await asyncio.sleep(0.05)
        assert not blocked.done()
        key.set_result("k")
        await blocked
        assert await w.commit() == 120
        assert await store.get("k") == b"x" * 60 + b"y" * 60

    asyncio.run(body())


def test_a_failed_key_fails_write_and_commit_and_abort_leaves_nothing() -> None:
    async def body() -> None:
        store = MemoryStore()
        key: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        w = DeferredWriter(store, key, limit=10)
        await w.write(b"held")
        key.set_exception(DistributedError("rank 0 could not claim a version"))
        with pytest.raises(DistributedError, match="could not claim"):
            await w.write(b"more than the limit")
        with pytest.raises(DistributedError):
            await w.commit()
        await w.abort()
        assert await store.list("") == []
        with pytest.raises(ValueError, match="limit"):
            DeferredWriter(store, key, limit=-1)

    asyncio.run(body())


def test_a_cancelled_write_does_not_cancel_the_shared_key() -> None:
    async def body() -> None:
        store = MemoryStore()
        key: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        a, b = DeferredWriter(store, key, limit=0), DeferredWriter(store, key, limit=0)
        waiting = asyncio.ensure_future(a.write(b"1"))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not key.cancelled()  # the other writer (and the save) still wait for it
        key.set_result("k2")
        await b.write(b"2")
        assert await b.commit() == 1
        await a.abort()
        assert await store.list("") == ["k2"]

    asyncio.run(body())
