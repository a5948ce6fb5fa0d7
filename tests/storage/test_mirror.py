"""MirrorStore: the conformance suite over local disk + memory and local disk + S3 (moto), plus
what only a mirror does (reads and listings fall back to the mirror, mirror first on commit)."""

from __future__ import annotations

import asyncio
import errno
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mithril_async.errors import StorageError
from mithril_async.storage import DirListing, LocalStore, MemoryStore, Store
from mithril_async.storage.local import LOCK_NAME
from mithril_async.storage.mirror import MirrorStore
from mithril_async.testing.store import StoreTests, payload
from tests.s3_server import MotoS3
from tests.storage.factories import LocalFactory, S3Factory


@dataclass
class MirrorFactory:
    """Both sides open on their own location each time; the suite's expectations are the
    weaker of the two sides'."""

    primary: LocalFactory
    remote: S3Factory | None = None
    memory: MemoryStore = field(default_factory=MemoryStore)  # one "bucket" for every new()

    @property
    def spill_size(self) -> int:
        return max(self.primary.spill_size, self.remote.spill_size if self.remote else 0)

    @property
    def large_size(self) -> int:
        return max(self.primary.large_size, self.remote.large_size if self.remote else 0)

    @property
    def knows_upload_age(self) -> bool:
        return self.primary.knows_upload_age and (self.remote is None
                                                  or self.remote.knows_upload_age)

    def new(self) -> MirrorStore:
        mirror: Store = self.remote.new() if self.remote else self.memory
        return MirrorStore(self.primary.new(), mirror)


class TestMirrorLocalMemory(StoreTests):
    @pytest.fixture
    def factory(self, tmp_path: Path) -> MirrorFactory:
        return MirrorFactory(LocalFactory(tmp_path / "local"))


class TestMirrorLocalS3(StoreTests):
    @pytest.fixture
    def factory(self, tmp_path: Path, s3_server: MotoS3) -> MirrorFactory:
        remote = S3Factory(s3_server, s3_server.unique_prefix("mirror"))
        return MirrorFactory(LocalFactory(tmp_path / "local"), remote)


def test_reads_and_listings_fall_back_to_the_mirror(tmp_path: Path) -> None:
    """A machine with only the bucket sees every key; one with both sees the union."""

    async def body() -> None:
        local, remote = LocalStore(tmp_path), MemoryStore()
        s = MirrorStore(local, remote)
        await s.put("runs/r/versions/v000001/manifest.json", b"m1")
        await remote.put("runs/r/versions/v000002/manifest.json", b"m2")  # only remote
        await local.put("runs/r/versions/v000003/model.mckp", b"b3")  # only local
        assert await s.get("runs/r/versions/v000002/manifest.json") == b"m2"
        assert await s.list_dir("runs/r/versions") == DirListing(
            [], ["v000001", "v000002", "v000003"])
        assert await s.list_dir("runs/r/versions/v000002/") == DirListing(["manifest.json"], [])
        assert await s.list("runs/r/versions/v000003") == ["runs/r/versions/v000003/model.mckp"]

    asyncio.run(body())


def test_writer_commits_the_mirror_before_the_primary(tmp_path: Path) -> None:
    seen: list[tuple[bool, bool]] = []

    class Watched(MemoryStore):
        async def _step(self, op: str, key: str) -> None:
            if op == "commit":  # what the primary holds when the mirror publishes
                seen.append((await local.exists(key), key in self._data))
            await super()._step(op, key)

    local = LocalStore(tmp_path)

    async def body() -> None:
        s = MirrorStore(local, Watched())
        async with s.open_writer("blob") as w:  # type: ignore[attr-defined]
            await w.write(b"data")
        assert await local.get("blob") == b"data"

    asyncio.run(body())
    assert seen == [(False, False)]


@pytest.mark.parametrize("op", ["write", "commit"])
def test_a_failure_on_one_side_leaves_nothing_on_either(tmp_path: Path, op: str) -> None:
    async def body() -> None:
        local, remote = LocalStore(tmp_path), MemoryStore()
        s = MirrorStore(local, remote)
        w = s.open_writer("v/blob")
        await w.write(payload(LocalFactory(tmp_path).spill_size + 1))  # the temp file exists
        remote.inject_fault(op, StorageError(errno.EIO, "injected"))
        with pytest.raises(StorageError, match="injected"):
            if op == "write":
                await w.write(b"more")
            else:
                await w.commit()
        assert await s.list("") == []
        assert await local.cleanup_incomplete("") == 0  # the local temp file went with it
        assert await remote.cleanup_incomplete("") == 0
        await w.abort()  # still safe

    asyncio.run(body())
    assert [p.name for p in tmp_path.rglob("*") if not p.is_dir()] in ([], [LOCK_NAME])


def test_concurrent_readers_adopt_a_mirror_only_key_once(tmp_path: Path) -> None:
    async def body() -> None:
        local, remote = LocalStore(tmp_path), MemoryStore()
        await remote.put("aliases/latest.json", b"{}")
        stores = [MirrorStore(LocalStore(tmp_path), remote) for _ in range(4)]
        got = await asyncio.gather(*(s.get_with_etag("aliases/latest.json") for s in stores))
        assert {g for g in got} == {got[0]} and got[0][0] == b"{}"
        assert await local.get("aliases/latest.json") == b"{}"

    asyncio.run(body())
