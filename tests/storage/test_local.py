"""LocalStore: the conformance suite plus file-system specifics (symlinks, temp files,
errno mapping, cross-process compare-and-swap)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import multiprocessing
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mithril_async.errors import KeyNotFound, StorageError, UnsafeKey
from mithril_async.storage import DirListing, LocalStore, MemoryStore, open_store
from mithril_async.storage.local import LOCK_NAME
from mithril_async.testing.store import StoreTests, payload
from tests.storage.factories import LocalFactory


class TestLocalStore(StoreTests):
    @pytest.fixture
    def factory(self, tmp_path: Path) -> LocalFactory:
        return LocalFactory(tmp_path / "store")


def files_under(root: Path) -> list[str]:
    """Every file below ``root`` except the (permanent) compare-and-swap lock file."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if not p.is_dir() and p.name != LOCK_NAME
    )


def test_symlinked_directory_pointing_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)

    async def body() -> None:
        s = LocalStore(root)
        with pytest.raises(UnsafeKey):
            await s.get("link/secret")
        with pytest.raises(UnsafeKey):
            await s.put("link/planted", b"x")
        with pytest.raises(UnsafeKey):
            await s.put("link/deeper/planted", b"x")
        w = s.open_writer("link/w")  # the check needs I/O: it runs with the first flush
        with pytest.raises(UnsafeKey):
            await w.write(b"x")
            await w.commit()
        with pytest.raises(UnsafeKey):
            await s.delete("link/secret")
        with pytest.raises(UnsafeKey):
            await s.list("link/")
        assert await s.list("") == []  # the walk does not follow the link

    asyncio.run(body())
    assert sorted(os.listdir(outside)) == ["secret"]


def test_symlinked_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret")
    root = tmp_path / "root"
    root.mkdir()
    (root / "alias").symlink_to(secret)

    async def body() -> None:
        s = LocalStore(root)
        for call in (s.get, s.size, s.exists, s.get_with_etag):
            with pytest.raises(UnsafeKey):
                await call("alias")
        with pytest.raises(UnsafeKey):
            await s.get_range("alias", 0, 3)
        assert await s.list("") == []
        await s.put("alias", b"replaced")  # rename replaces the link itself, not its target
        assert await s.get("alias") == b"replaced"

    asyncio.run(body())
    assert secret.read_bytes() == b"secret"


@contextlib.contextmanager
def _a_writer_waits_at(fifo: Path) -> Iterator[None]:
    """A thread opens ``fifo``'s write end and closes it at once. Its open blocks until a
    reader opens the other end, so a read that blocks in ``open`` is met (and then reads
    EOF: an empty value) instead of hanging the test; at the end the thread is released by
    a non-blocking read open of our own if no read met it."""
    thread = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)), daemon=True)
    thread.start()
    try:
        yield
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        thread.join()
        os.close(fd)


@pytest.mark.parametrize("op", ["get", "get_range", "get_with_etag", "open_range_reader",
                                "size", "put_if_match"])
def test_a_fifo_at_a_key_is_refused_not_waited_on(tmp_path: Path, op: str) -> None:
    """A FIFO planted at a key: every read refuses it (UnsafeKey naming the key) instead of
    waiting in ``open`` for a writer that may never come (a restore would hang), or
    reading whatever a writer sends as if it were the stored value."""
    root = tmp_path / "root"
    (root / "v").mkdir(parents=True)
    fifo = root / "v" / "blob"
    os.mkfifo(fifo)
    store = LocalStore(root)
    calls = {"get": lambda: store.get("v/blob"),
             "get_range": lambda: store.get_range("v/blob", 0, 8),
             "get_with_etag": lambda: store.get_with_etag("v/blob"),
             "open_range_reader": lambda: store.open_range_reader("v/blob"),
             "size": lambda: store.size("v/blob"),
             "put_if_match": lambda: store.put_if_match("v/blob", b"new", "some-tag")}
    with _a_writer_waits_at(fifo), pytest.raises(UnsafeKey, match=r"'v/blob'.*a FIFO"):
        asyncio.run(calls[op]())
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert asyncio.run(store.list("")) == []


def test_a_regular_files_descriptor_is_blocking(tmp_path: Path) -> None:
    """``O_NONBLOCK`` is only for the open: the range reader's descriptor is blocking."""
    (tmp_path / "k").write_bytes(b"value")
    reader = asyncio.run(LocalStore(tmp_path).open_range_reader("k"))
    assert reader is not None
    try:
        assert os.get_blocking(reader._fd) and reader.read(0, 5) == b"value"
    finally:
        reader.close()


def test_symlink_inside_root_is_allowed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "alias").symlink_to(root / "real", target_is_directory=True)

    async def body() -> None:
        s = LocalStore(root)
        await s.put("alias/x", b"1")
        assert await s.get("real/x") == b"1"

    asyncio.run(body())


def test_no_temp_files_left_and_planted_temps_ignored(tmp_path: Path) -> None:
    async def body() -> None:
        s = LocalStore(tmp_path)
        await s.put("a/b", b"1")
        await s.put_if_absent("a/c", b"2")
        await s.put_if_match("a/d", b"3", None)
        w = s.open_writer("a/e")
        await w.write(payload(3 << 20))
        await w.commit()
        assert files_under(tmp_path) == ["a/b", "a/c", "a/d", "a/e"]
        (tmp_path / "a" / ".tmp-x.123.abcd").write_bytes(b"junk")
        (tmp_path / "a" / "bad name").write_bytes(b"junk")
        assert await s.list("") == ["a/b", "a/c", "a/d", "a/e"]

    asyncio.run(body())


def test_writer_temp_lives_beside_target(tmp_path: Path) -> None:
    async def body() -> None:
        s = LocalStore(tmp_path)
        w = s.open_writer("d/blob")
        await w.write(payload(2 << 20))
        names = os.listdir(tmp_path / "d")
        assert len(names) == 1 and names[0].startswith(".tmp-blob.")
        await w.commit()
        assert os.listdir(tmp_path / "d") == ["blob"]

    asyncio.run(body())


def test_cleanup_incomplete_planted_temps_by_age(tmp_path: Path) -> None:
    d = tmp_path / "runs" / "r"
    d.mkdir(parents=True)
    old, new = d / ".tmp-blob.1.aaaa", d / ".tmp-blob.2.bbbb"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (1, 1))
    (tmp_path / LOCK_NAME).write_bytes(b"")

    async def body() -> None:
        s = LocalStore(tmp_path)
        assert await s.cleanup_incomplete("runs", older_than=60) == 1
        assert not old.exists() and new.exists()
        assert await s.cleanup_incomplete("runs/r/blob") == 1  # temps of that very key
        assert await s.cleanup_incomplete("") == 0
        assert (tmp_path / LOCK_NAME).exists()  # the lock file is never removed

    asyncio.run(body())
    assert not (tmp_path / "runs").exists()  # emptied directories are pruned


def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    async def body() -> None:
        s = LocalStore(tmp_path)
        await s.put("x/y/z", b"1")
        await s.put("x/w", b"1")
        await s.delete("x/y/z")
        assert not (tmp_path / "x" / "y").exists()
        assert (tmp_path / "x").exists()

    asyncio.run(body())


def test_delete_whose_folder_a_concurrent_delete_removed(tmp_path: Path) -> None:
    """Deletes of a folder's last two files at once (a version's files go concurrently):
    the one whose folder the other emptied and pruned between its unlink and its directory
    sync succeeds."""
    async def body() -> None:
        s = LocalStore(tmp_path)
        await s.put("v/a", b"1")
        await s.put("v/b", b"2")
        real, folder = s._sync_dir, str(tmp_path / "v")

        def racing(path: str) -> None:
            if path == folder and os.path.isdir(path):  # the other delete, right here
                os.unlink(os.path.join(path, "b"))
                os.rmdir(path)
            real(path)

        s._sync_dir = racing  # type: ignore[method-assign]
        await s.delete("v/a")
        assert not (tmp_path / "v").exists()

    asyncio.run(body())


def _raise_enospc(*_args: object, **_kwargs: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_enospc_keeps_errno_names_path_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        s = LocalStore(tmp_path)
        await s.put("keep", b"old")
        monkeypatch.setattr("mithril_async.storage.local.os.write", _raise_enospc)
        with pytest.raises(StorageError) as info:
            await s.put("keep", b"new")
        assert info.value.errno == errno.ENOSPC
        assert "keep" in str(info.value) and not isinstance(info.value, KeyNotFound)
        w = s.open_writer("big")
        with pytest.raises(StorageError) as info:
            await w.write(payload(2 << 20))
        assert info.value.errno == errno.ENOSPC
        assert "big" in str(info.value)
        await w.abort()
        monkeypatch.undo()
        assert await s.get("keep") == b"old"
        assert files_under(tmp_path) == ["keep"]

    asyncio.run(body())


def test_fsync_eio_on_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        s = LocalStore(tmp_path)
        w = s.open_writer("blob")
        await w.write(b"abc")

        def eio(_fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr("mithril_async.storage.local.os.fsync", eio)
        with pytest.raises(StorageError) as info:
            await w.commit()
        assert info.value.errno == errno.EIO
        monkeypatch.undo()
        assert files_under(tmp_path) == []

    asyncio.run(body())


def _cas_worker(root: str, increments: int) -> None:
    from mithril_async.errors import PreconditionFailed

    async def main() -> None:
        s = LocalStore(root)
        for _ in range(increments):
            while True:
                data, tag = await s.get_with_etag("counter")
                try:
                    await s.put_if_match("counter", str(int(data) + 1).encode(), tag)
                    break
                except PreconditionFailed:
                    continue

    asyncio.run(main())


def test_put_if_match_across_processes(tmp_path: Path) -> None:
    asyncio.run(LocalStore(tmp_path).put("counter", b"0"))
    ctx = multiprocessing.get_context("fork")  # spawn would re-import torch per child
    procs = [ctx.Process(target=_cas_worker, args=(str(tmp_path), 25)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert asyncio.run(LocalStore(tmp_path).get("counter")) == b"75"


def test_open_store_factory(tmp_path: Path) -> None:
    for spec in (str(tmp_path), f"file://{tmp_path}", f"local://{tmp_path}", tmp_path):
        store = open_store(spec)
        assert isinstance(store, LocalStore)
        assert store.root == os.path.realpath(tmp_path)
    assert isinstance(open_store("memory://"), MemoryStore)
    with pytest.raises(ValueError):
        open_store("ftp://x/y")
    with pytest.raises(ValueError):
        open_store("file://relative/path")


def test_list_dir_skips_what_is_no_key(tmp_path: Path) -> None:
    """Empty directories, directories holding only temp files or names no key can have, and
    symlinks are not listed, so a listing matches what ``list`` sees."""
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "secret").write_bytes(b"s")
    root = tmp_path / "root"
    (root / "empty" / "deeper").mkdir(parents=True)
    (root / "temps").mkdir()
    (root / "temps" / ".tmp-blob.1.abcd").write_bytes(b"t")
    (root / "bad name").mkdir()
    (root / "bad name" / "k").write_bytes(b"x")
    (root / "hidden" / "bad name").mkdir(parents=True)
    (root / "hidden" / "bad name" / "k").write_bytes(b"x")
    (root / ".tmp-dir").mkdir()
    (root / ".tmp-dir" / "k").write_bytes(b"x")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "file-link").symlink_to(outside / "d" / "secret")
    (root / LOCK_NAME).write_bytes(b"")

    async def body() -> None:
        s = LocalStore(root)
        await s.put("real/deep/k", b"1")
        await s.put("top", b"1")
        assert await s.list("") == ["real/deep/k", "top"]
        assert await s.list_dir("") == DirListing(["top"], ["real"])
        assert await s.list_dir("real") == DirListing([], ["deep"])
        assert await s.list_dir("empty") == DirListing([], [])
        assert await s.list_dir("temps/") == DirListing([], [])
        assert await s.list_dir("hidden") == DirListing([], [])
        with pytest.raises(UnsafeKey):
            await s.list_dir("link/")
        with pytest.raises(UnsafeKey):
            await s.list_dir("link/d")

    asyncio.run(body())
