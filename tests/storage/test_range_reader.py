"""LocalStore's range reader (``open_range_reader``): one open file read on worker threads
gives exactly what ``get_range`` gives, refuses what ``get_range`` refuses with the same typed
errors, is offered only where ``get_range`` is LocalStore's own, and never closes its file
under a read that is still running."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from types import ModuleType

import pytest

from mithril_async.errors import KeyNotFound, StorageError, UnsafeKey
from mithril_async.storage import LocalStore, MemoryStore, local_reads
from mithril_async.storage import local as local_mod
from mithril_async.storage.capabilities import RangeReader, RangeReading

DATA = bytes(range(256)) * 41  # 10,496 bytes


async def open_range_reader(store: object, key: str) -> RangeReader | None:
    """What a restore gets: the store's range reader where it declares one, else None."""
    return await store.open_range_reader(key) if isinstance(store, RangeReading) else None


def _store(tmp_path: Path) -> LocalStore:
    root = tmp_path / "root"
    (root / "v").mkdir(parents=True)
    (root / "v" / "blob").write_bytes(DATA)
    return LocalStore(root)


def test_reads_what_get_range_reads(tmp_path: Path) -> None:
    store = _store(tmp_path)

    async def body() -> None:
        reader = await open_range_reader(store, "v/blob")
        assert reader is not None
        try:
            for start, length in [(0, 10), (5, 4096), (10_000, 496), (10_400, 500),
                                  (len(DATA), 8), (0, len(DATA))]:
                want = await store.get_range("v/blob", start, length)
                assert reader.read(start, length) == want == DATA[start:start + length]
            with pytest.raises(ValueError, match="v/blob"):
                await store.get_range("v/blob", -1, 4)
            with pytest.raises(ValueError, match="v/blob"):
                reader.read(-1, 4)
        finally:
            reader.close()
            reader.close()  # idempotent
        with pytest.raises(StorageError, match="reader closed"):
            reader.read(0, 4)

    asyncio.run(body())


def test_refuses_what_get_range_refuses(tmp_path: Path) -> None:
    store = _store(tmp_path)
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "v" / "alias").symlink_to(root / "v" / "blob")
    (root / "v" / "folder").mkdir()

    async def body() -> None:
        for key, err in [("v/missing", KeyNotFound), ("link/secret", UnsafeKey),
                         ("v/alias", UnsafeKey), ("v/folder", StorageError)]:
            with pytest.raises(err) as via_get:
                await store.get_range(key, 0, 4)
            with pytest.raises(err) as via_reader:
                await open_range_reader(store, key)
            assert type(via_reader.value) is type(via_get.value), key

    asyncio.run(body())


class CountingStore(LocalStore):
    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await super().get_range(key, start, length)


def test_only_where_get_range_is_the_local_one(tmp_path: Path) -> None:
    """A subclass that reads ranges its own way keeps that way; a store without a reader
    (memory, S3, wrappers) answers None: the caller uses get_range."""
    _store(tmp_path)

    async def body() -> None:
        assert await open_range_reader(CountingStore(tmp_path / "root"), "v/blob") is None
        mem = MemoryStore()
        await mem.put("v/blob", DATA)
        assert await open_range_reader(mem, "v/blob") is None

    asyncio.run(body())


def test_close_waits_for_a_running_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() while a read runs on another thread: the descriptor stays open (the same
    file) until that read ends, which returns the right bytes; then it is closed."""
    store = _store(tmp_path)
    entered, release = threading.Event(), threading.Event()
    real = local_reads.pread

    def gated(fs: ModuleType, fd: int, start: int, length: int) -> bytes:
        entered.set()
        assert release.wait(30)
        return real(fs, fd, start, length)

    async def open_it() -> local_mod.LocalRangeReader:
        r = await store.open_range_reader("v/blob")
        assert r is not None
        return r

    reader = asyncio.run(open_it())
    fd = reader._fd
    monkeypatch.setattr(local_reads, "pread", gated)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(reader.read(100, 50)))
    t.start()
    assert entered.wait(30)
    reader.close()
    st = os.fstat(fd)  # still open, still the blob
    assert (st.st_ino, st.st_size) == (os.stat(tmp_path / "root" / "v" / "blob").st_ino,
                                       len(DATA))
    release.set()
    t.join(30)
    assert got == [DATA[100:150]]
    assert reader._fd == -1  # the read that ended last closed it
    with pytest.raises(StorageError, match="reader closed"):
        reader.read(0, 4)


def test_a_cancelled_open_leaves_no_file_open(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller cancelled while its worker thread opens the file (a failed restore cancels
    the other blobs' tasks) never gets the reader: the descriptor is closed, not left open
    for the rest of the process."""
    store = _store(tmp_path)
    opened, release = threading.Event(), threading.Event()
    real = local_reads.open_file
    fds: list[int] = []

    def gated(fs: ModuleType, path: str) -> int:
        fd = real(fs, path)
        fds.append(fd)
        opened.set()
        assert release.wait(30)
        return fd

    monkeypatch.setattr(local_reads, "open_file", gated)

    async def body() -> None:
        task = asyncio.ensure_future(store.open_range_reader("v/blob"))
        assert await asyncio.to_thread(opened.wait, 30)
        task.cancel()
        await asyncio.sleep(0)  # the cancel reaches the open, which waits for its thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert len(fds) == 1
    blob = str(tmp_path / "root" / "v" / "blob")
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    assert blob not in held
