"""The atomic-write helper: the whole recipe (write, fsync file, rename, fsync folder) and what
a failure leaves (the old file, no temp file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

import pytest

from mithril_async.storage.atomic import (
    atomic_file,
    atomic_write,
    create_temp,
    fsync_dir,
    temp_path,
    write_all,
)
from mithril_async.storage.base import RESERVED_PREFIX


class FsyncLog:
    """Records what ``os.fsync`` was called on: ``"dir"`` or ``"file"``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: list[str] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            self.synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def test_atomic_write_bytes_and_callback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = FsyncLog(monkeypatch)
    target = tmp_path / "out.bin"
    atomic_write(target, b"first")
    assert target.read_bytes() == b"first"
    assert log.synced == ["file", "dir"]  # the temp file, then the folder after the rename

    def writer(f: IO[bytes]) -> None:
        f.write(b"sec")
        f.write(memoryview(b"ond"))

    atomic_write(str(target), writer)
    assert target.read_bytes() == b"second"
    atomic_write(target, memoryview(b"third"))
    assert target.read_bytes() == b"third"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_failed_write_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "keep.bin"
    target.write_bytes(b"old")

    def boom(f: IO[bytes]) -> None:
        f.write(b"partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_write(target, boom)
    with pytest.raises(RuntimeError), atomic_file(target) as f:
        f.write(b"partial")
        raise RuntimeError("inside the block")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["keep.bin"]
    with pytest.raises(FileNotFoundError):  # the folder must exist
        atomic_write(tmp_path / "missing" / "x", b"x")


def test_durable_false_skips_every_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = FsyncLog(monkeypatch)
    atomic_write(tmp_path / "fast", b"x", durable=False)
    assert (tmp_path / "fast").read_bytes() == b"x"
    assert log.synced == []


def test_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = str(tmp_path / ("n" * 200))
    tmp = temp_path(target)
    assert os.path.dirname(tmp) == str(tmp_path)
    assert os.path.basename(tmp).startswith(RESERVED_PREFIX + "n" * 100 + f".{os.getpid()}.")
    assert temp_path(target) != tmp
    fd, tmp = create_temp(target)
    try:
        write_all(fd, memoryview(b"abc" * 1000))
    finally:
        os.close(fd)
    assert Path(tmp).read_bytes() == b"abc" * 1000
    assert stat.S_IMODE(os.stat(tmp).st_mode) & 0o600 == 0o600
    log = FsyncLog(monkeypatch)
    fsync_dir(str(tmp_path))
    assert log.synced == ["dir"]


def test_calls_go_through_the_given_fs(tmp_path: Path) -> None:
    """LocalStore passes its module's ``os``; the helpers must call nothing else."""
    calls: list[str] = []

    class Recording:
        def __getattr__(self, name: str) -> object:
            real = getattr(os, name)

            def call(*args: object) -> object:
                calls.append(name)
                return real(*args)

            return call

    fs = Recording()
    fd, _tmp = create_temp(str(tmp_path / "x"), fs=fs)  # type: ignore[arg-type]
    write_all(fd, b"data", fs=fs)  # type: ignore[arg-type]
    fs.close(fd)  # type: ignore[attr-defined]
    fsync_dir(str(tmp_path), fs=fs)  # type: ignore[arg-type]
    assert calls == ["open", "write", "close", "open", "fsync", "close"]
