"""S3Store against real S3-compatible servers over HTTP on loopback, moto and a real Ceph
RGW (every test runs on both; the RGW runs are skipped, saying why, where Ceph cannot run):
the shared conformance suite, then multipart, parallel reads, conditional writes, the quirks
of real servers and injected faults (through a proxy in front of either server)."""

from __future__ import annotations

import asyncio
import errno
import logging
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import boto3
import pytest

from mithril_async.config import RemoteConfig
from mithril_async.errors import KeyExists, KeyNotFound, PreconditionFailed, StorageError
from mithril_async.storage import DirListing, open_store
from mithril_async.storage.s3 import (
    MAX_OBJECT_SIZE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MAX_RANGE,
    MIB,
    MIN_PART_SIZE,
    S3Store,
    S3Writer,
    composite_crc32,
    crc32_b64,
    max_blob_size,
    part_size_at,
    part_size_for,
    range_size,
)
from mithril_async.testing.store import StoreTests
from mithril_async.testing.store import run as run_with_store
from tests import rgw_server
from tests.rgw_server import CephRGW, RGWUnavailable
from tests.s3_server import SMALL_PART, FaultProxy, MotoS3, S3Server, fault_proxy
from tests.storage.factories import S3Factory


@pytest.fixture(scope="module", params=["moto", "rgw"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """Every test of this module runs on moto and on Ceph RGW (grouped by server)."""
    server: S3Server = request.getfixturevalue(f"{request.param}_server")
    return server


class TestS3Store(StoreTests):
    @pytest.fixture
    def factory(self, s3_server: S3Server) -> S3Factory:
        return S3Factory(s3_server, s3_server.unique_prefix())


# -- the RGW launcher ----------------------------------------------------------------------
def test_rgw_launcher_says_when_ceph_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rgw_server, "BINARIES", ("ceph-mon", "no-such-ceph-binary"))
    with (pytest.raises(RGWUnavailable, match=r"not installed.*no-such-ceph-binary.*system-deps"),
          CephRGW()):
        pass


class _FailsAfterTheMonitor(CephRGW):
    def _osd_up(self) -> bool:
        raise RGWUnavailable("injected: the OSD never comes up")


def test_rgw_launcher_stops_what_it_started_when_the_start_fails() -> None:
    """A start failing half-way (the monitor up, the OSD not) stops the daemons already
    running, by their pid files, removes its folder and says what went wrong."""
    if rgw_server.missing_binaries():
        pytest.skip(f"Ceph is not installed: missing {rgw_server.missing_binaries()}")
    rgw = _FailsAfterTheMonitor()
    with pytest.raises(RGWUnavailable, match="did not start: injected") as info:
        rgw.__enter__()
    assert "mon.a.log" in str(info.value)  # the daemons' log tails are in the message
    assert len(rgw.stopped) >= 2 and rgw.dir is None  # the monitor and the OSD process
    assert not [pid for pid in rgw.stopped if rgw_server._alive(pid)]


def run(coro_fn: Any, factory: S3Factory) -> Any:
    """The suite's runner, arguments in this module's order."""
    return run_with_store(factory, coro_fn)


@pytest.fixture
def factory(s3_server: S3Server) -> S3Factory:
    return S3Factory(s3_server, s3_server.unique_prefix("s3"))


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with fault_proxy(s3_server) as p:
        yield p


def via_proxy(factory: S3Factory, proxy: FaultProxy, **changes: Any) -> S3Factory:
    return replace(factory, endpoint_url=proxy.endpoint_url, **changes)


def blob(n: int, seed: int = 7) -> bytes:
    return random.Random(seed).randbytes(n)


# -- multipart -------------------------------------------------------------------------------
def test_large_blob_is_multipart_with_crc32_per_part(
    s3_server: S3Server, factory: S3Factory, proxy: FaultProxy
) -> None:
    f = via_proxy(factory, proxy, max_concurrency=2)
    data = blob(5 * f.part_size + 1234)
    full = f"{f.prefix}/big"

    async def body(s: S3Store) -> None:
        w = s.open_writer("big")
        for i in range(0, len(data), 100_000):
            await w.write(data[i : i + 100_000])
        assert w.upload_id is not None
        assert [u["Key"] for u in s3_server.uploads(f.prefix)] == [full]
        def landed() -> int:
            return len(s3_server.client.list_parts(Bucket=s3_server.bucket, Key=full,
                                                   UploadId=w.upload_id).get("Parts", []))

        deadline = time.monotonic() + 60  # a safety net: the parts are already on their way
        while landed() < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert landed() >= 4  # streamed while writing, before the commit
        assert await w.commit() == len(data)
        assert await s.get("big") == data

    run(body, f)
    head = s3_server.client.head_object(Bucket=s3_server.bucket, Key=full)
    assert head["ETag"].strip('"').endswith("-6")
    assert s3_server.uploads(f.prefix) == []
    part_puts = [r for r in proxy.log if r.is_upload_part]
    assert len(part_puts) == 6
    for r in part_puts:
        n = int(r.query["partNumber"][0])
        piece = data[(n - 1) * f.part_size : n * f.part_size]
        assert r.headers["x-amz-checksum-crc32"] == crc32_b64(piece)
        assert r.body_size == len(piece)
    assert proxy.max_in_flight <= 2  # bounded concurrency (only the writer uses this proxy)


def test_writer_blocks_when_parts_are_in_flight(factory: S3Factory, proxy: FaultProxy) -> None:
    """Back-pressure: with both upload slots held unanswered by the server, handing over 6
    parts does not finish (at most ~(max_concurrency + 2) part buffers ever exist, whatever
    the machine's speed); once the server answers it does, never with > 2 parts in flight."""
    f = via_proxy(factory, proxy, max_concurrency=2)
    held = proxy.fail(lambda r: r.is_upload_part, "hold", times=2)
    data = blob(6 * f.part_size)

    async def body(s: S3Store) -> None:
        w = s.open_writer("slow")
        handing_over = asyncio.ensure_future(w.write(data))
        deadline = time.monotonic() + 60  # a safety net: the two parts arrive at once
        while held.hits < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert held.hits == 2
        await asyncio.sleep(0.3)
        assert not handing_over.done()  # both slots are taken: the writer waits
        held.released.set()  # the held parts are reset by the server and retried
        await handing_over
        await w.commit()
        assert await s.get("slow") == data

    run(body, f)
    assert proxy.max_in_flight <= 2


def test_small_blob_is_a_single_put(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy)

    async def body(s: S3Store) -> None:
        w = s.open_writer("small")
        await w.write(b"a" * (f.part_size - 1))
        await w.commit()

    run(body, f)
    writes = [r for r in proxy.log if r.method in ("PUT", "POST")]
    assert len(writes) == 1 and not writes[0].query
    assert writes[0].headers["x-amz-checksum-crc32"] == crc32_b64(b"a" * (f.part_size - 1))


def test_part_size_grows_to_stay_under_the_part_limit(factory: S3Factory) -> None:
    w = factory.new().open_writer("k")
    assert w._part_size(1) == w._part_size(900) == factory.part_size
    assert w._part_size(901) == 2 * factory.part_size
    assert w._part_size(9999) == 2048 * factory.part_size
    hinted = factory.new().open_writer("k", size_hint=100 * MIB * 10_000)
    assert hinted._part_size(1) == 100 * MIB
    with pytest.raises(ValueError):
        S3Store("b", part_size=1 << 20)  # below S3's 5 MiB minimum


def test_part_size_for_keeps_any_object_under_the_part_limit() -> None:
    # unknown total: from S3's 5 MiB minimum the growing parts cover S3's largest object
    assert part_size_for(None, MIN_PART_SIZE) == MIN_PART_SIZE
    assert max_blob_size(MIN_PART_SIZE) >= MAX_OBJECT_SIZE
    assert max_blob_size(8 * MIB) >= MAX_OBJECT_SIZE
    sizes = [part_size_at(MIN_PART_SIZE, n) for n in range(1, MAX_PARTS + 1)]
    assert sizes == sorted(sizes) and sizes[-1] == MAX_PART_SIZE
    assert sum(sizes) == max_blob_size(MIN_PART_SIZE)
    # known totals: one size for every part when the configured size would need > 10,000
    assert part_size_for(10 * MIB, 8 * MIB) == 8 * MIB
    assert part_size_for(1024**4, 8 * MIB) == 105 * MIB  # 1 TiB / 10,000, rounded up to MiB
    for total in (1024**4 + 1, MAX_OBJECT_SIZE, 3 * 1024**4 + 12345):
        first = part_size_for(total, MIN_PART_SIZE)
        assert first % MIB == 0 and MAX_PARTS * first >= total
    assert part_size_for(10 * MAX_OBJECT_SIZE, 8 * MIB) == MAX_PART_SIZE  # capped


# -- reads ------------------------------------------------------------------------------------
def test_parallel_ranged_reads(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy, max_concurrency=4)
    data = blob(8 * f.part_size + 77)

    async def body(s: S3Store) -> None:
        await s.put("r", data)
        proxy.clear()
        assert await s.get("r") == data
        gets = [r for r in proxy.log if r.method == "GET"]
        assert len(gets) == 9 and all("range" in r.headers for r in gets)
        assert proxy.max_in_flight >= 2
        unpinned = [r for r in gets if not r.headers.get("if-match")]
        assert len(unpinned) == 1  # the first range; the others are pinned to one version
        assert len([r for r in proxy.log if r.method == "HEAD"]) == 1
        start = f.part_size // 2
        got = await s.get_range("r", start, 3 * f.part_size)
        assert got == data[start : start + 3 * f.part_size]
        assert await s.get_range("r", len(data) - 10, 1000) == data[-10:]
        many = await asyncio.gather(
            *(s.get_range("r", i * 1000, 5000) for i in range(20))
        )
        assert many == [data[i * 1000 : i * 1000 + 5000] for i in range(20)]

    run(body, f)


def test_read_stays_within_max_concurrency_from_its_first_request(
    factory: S3Factory, proxy: FaultProxy
) -> None:
    """The first range and the HEAD beside it take slots like every other range: with the
    first range held unanswered by the server, at most one more request is in flight."""
    f = via_proxy(factory, proxy, max_concurrency=2)
    data = blob(6 * f.part_size + 3)

    async def body(s: S3Store) -> None:
        await s.put("r", data)
        proxy.clear()
        first = proxy.fail(lambda r: r.method == "GET" and "if-match" not in r.headers, "hold")
        pinned = proxy.fail(lambda r: r.method == "GET" and "if-match" in r.headers, "hold",
                            times=None)
        reading = asyncio.ensure_future(s.get("r"))
        deadline = time.monotonic() + 60  # a safety net: these requests go out at once
        while not (first.hits and pinned.hits) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert first.hits == 1 and pinned.hits >= 1
        await asyncio.sleep(0.3)  # room for requests over the limit to show up
        in_flight = proxy.max_in_flight
        for fault in (first, pinned):  # stop holding; the held requests are retried
            fault.times = fault.hits
            fault.released.set()
        assert await reading == data
        assert in_flight <= 2

    run(body, f)
    assert proxy.max_in_flight <= 2


def test_range_size_bounds() -> None:
    part = 8 * MIB
    assert range_size(10 * MIB, part, 8) == part  # small reads: one part per range
    assert range_size(1024 * MIB, part, 8) == 32 * MIB  # 1 GiB: 4 ranges per connection
    assert range_size(1 << 40, part, 8) == MAX_RANGE  # capped
    assert range_size(100 * MIB + 1, part, 1) == 32 * MIB  # rounded up to whole parts


def test_big_reads_use_fewer_larger_ranges(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy, max_concurrency=2)
    data = blob(40 * f.part_size + 5)
    step = range_size(len(data) - f.part_size, f.part_size, 2)
    assert step > f.part_size

    async def body(s: S3Store) -> None:
        await s.put("big", data)
        proxy.clear()
        assert await s.get("big") == data
        gets = [r for r in proxy.log if r.method == "GET"]
        assert len(gets) == 1 + -(-(len(data) - f.part_size) // step) < 41
        assert proxy.max_in_flight >= 2

    run(body, f)


def test_read_restarts_when_object_is_replaced_midway(factory: S3Factory) -> None:
    old, new = blob(3 * factory.part_size, 1), blob(3 * factory.part_size, 2)

    async def body(s: S3Store) -> None:
        await s.put("r", old)
        real = s._get_once
        calls = 0

        async def replacing(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # a writer sneaks in after the first range pinned the old ETag
                await s.put("r", new)
            return await real(*args)

        s._get_once = replacing  # type: ignore[method-assign]
        assert await s.get("r") == new

    run(body, factory)


def test_missing_bucket_is_a_storage_error_not_key_not_found(factory: S3Factory) -> None:
    async def body(s: S3Store) -> None:
        with pytest.raises(StorageError) as info:
            await s.get("k")
        assert not isinstance(info.value, KeyNotFound)
        assert "no-such-bucket-xyz" in str(info.value)

    run(body, replace(factory, server=replace_bucket(factory.server, "no-such-bucket-xyz")))


def replace_bucket(server: S3Server, bucket: str) -> S3Server:
    clone: S3Server = object.__new__(type(server))
    clone.__dict__.update(server.__dict__, bucket=bucket)
    return clone


# -- listings ---------------------------------------------------------------------------------
def test_list_dir_is_one_delimited_listing_skipping_foreign_names(
    s3_server: S3Server, factory: S3Factory, proxy: FaultProxy
) -> None:
    """Objects other tools wrote under names no key can have are left out, as ``list`` does;
    a neighbouring prefix (``<prefix>x``) is not part of the store."""
    f = via_proxy(factory, proxy)
    for name in ("x/ok", "x/sub/k", "x/.tmp-y", "x/bad name", "x/bad dir/k", "x/", "x//z"):
        s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{f.prefix}/{name}", Body=b"")
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{f.prefix}x/k", Body=b"")

    async def body(s: S3Store) -> None:
        assert await s.list("x") == ["x/ok", "x/sub/k"]
        proxy.log.clear()
        assert await s.list_dir("x") == DirListing(["ok"], ["sub"])
        [request] = proxy.log
        assert request.query["delimiter"] == ["/"] and request.query["prefix"] == [f"{f.prefix}/x/"]
        assert await s.list_dir("") == DirListing([], ["x"])

    run(body, f)


# -- conditional writes -----------------------------------------------------------------------
def test_conditional_writes_detected_as_native(factory: S3Factory) -> None:
    async def body(s: S3Store) -> None:
        assert s.conditional_writes == "auto"
        assert await s.detect_conditional_writes() is True
        assert s.conditional_writes == "native" and s.atomic_conditional_writes
        assert await s.list("") == []  # the probe object is gone

    run(body, factory)


def test_emulated_conditional_writes_are_flagged_and_logged(
    factory: S3Factory, caplog: pytest.LogCaptureFixture
) -> None:
    f = replace(factory, options={"conditional_writes": "emulate"})

    async def body(s: S3Store) -> None:
        assert s.atomic_conditional_writes is False
        await s.put_if_absent("k", b"1")
        with pytest.raises(KeyExists):
            await s.put_if_absent("k", b"2")
        _, tag = await s.get_with_etag("k")
        tag2 = await s.put_if_match("k", b"3", tag)
        with pytest.raises(PreconditionFailed):
            await s.put_if_match("k", b"4", tag)
        assert (await s.get_with_etag("k")) == (b"3", tag2)

    with caplog.at_level(logging.WARNING, logger="mithril_async.storage.s3"):
        run(body, f)
    assert "NON-ATOMIC" in caplog.text


# -- quirks of real S3-compatible servers (Ceph RGW), played by the proxy ----------------------
IF_MATCH_PUT = lambda r: r.method == "PUT" and "if-match" in r.headers  # noqa: E731


def test_a_server_ignoring_if_match_gets_the_logged_fallback(
    moto_server: MotoS3, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that honours ``If-None-Match`` but ignores ``If-Match`` must not be trusted
    with compare-and-swap: the probe's PUT with a wrong ``If-Match`` is stored there, so the
    store falls back (logged) and a stale ETag still loses instead of overwriting. On moto
    only: the proxy plays the server by dropping the header, which RGW refuses since the
    request's signature covers it."""
    with fault_proxy(moto_server) as proxy:
        f = via_proxy(S3Factory(moto_server, moto_server.unique_prefix("s3")), proxy)
        quirk = proxy.fail(IF_MATCH_PUT, "ignore_if_match", times=None)
        with caplog.at_level(logging.WARNING, logger="mithril_async.storage.s3"):
            run(_cas_against_a_server_ignoring_if_match, f)
        assert quirk.hits == 1  # the probe's: the fallback sends no If-Match
    assert "ignores If-Match" in caplog.text and "NON-ATOMIC" in caplog.text


async def _cas_against_a_server_ignoring_if_match(s: S3Store) -> None:
    assert await s.detect_conditional_writes() is False
    assert s.conditional_writes == "emulate" and s.atomic_conditional_writes is False
    await s.put("alias", b"v0")
    _, tag = await s.get_with_etag("alias")
    await s.put_if_match("alias", b"v1", tag)
    with pytest.raises(PreconditionFailed):
        await s.put_if_match("alias", b"lost update", tag)
    assert await s.get("alias") == b"v1"
    assert await s.list("") == ["alias"]  # the probe object is gone


@pytest.mark.parametrize("condition", ["if-match", "if-none-match"])
def test_a_conditional_put_answered_without_etag_succeeded(
    factory: S3Factory, proxy: FaultProxy, condition: str
) -> None:
    """A conditional PUT the server stored but answered without an ETag is a success, and
    returns the stored object's ETag, which the next compare-and-swap can use."""
    f = via_proxy(factory, proxy)

    async def body(s: S3Store) -> None:
        assert await s.detect_conditional_writes() is True
        quirk = proxy.fail(lambda r: r.method == "PUT" and condition in r.headers, "no_etag",
                           times=None)
        tag = None
        if condition == "if-match":
            await s.put("alias", b"v0")
            _, tag = await s.get_with_etag("alias")
        tag1 = await s.put_if_match("alias", b"v1", tag)
        assert await s.get_with_etag("alias") == (b"v1", tag1)
        if condition == "if-match":
            tag2 = await s.put_if_match("alias", b"v2", tag1)
            assert await s.get_with_etag("alias") == (b"v2", tag2)
            with pytest.raises(PreconditionFailed):
                await s.put_if_match("alias", b"stale", tag1)
        assert quirk.hits >= 1

    run(body, f)


def test_empty_completion_etag_is_filled_from_a_head(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy)
    data = blob(3 * f.part_size + 5)
    quirk = proxy.fail(lambda r: r.is_complete, "empty_etag", times=None)

    async def body(s: S3Store) -> None:
        w = s.open_writer("big")
        await w.write(data)
        assert await w.commit() == len(data)
        assert await s.get("big") == data

    run(body, f)
    assert quirk.hits == 1
    after = proxy.log[[r.is_complete for r in proxy.log].index(True) + 1 :]
    assert after[0].method == "HEAD" and after[0].path.endswith("/big")
    assert after[0].headers.get("x-amz-checksum-mode") == "ENABLED"  # compared if returned


class _CompletesWithoutETag:
    """The S3Requests of a server whose completion has no ETag and whose HEAD shows
    ``head`` (a unit double: a size mismatch cannot be produced by a correct server)."""

    part_size = SMALL_PART
    max_concurrency = 2

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head
        self.aborted = False

    def full_key(self, key: str) -> str:
        return key

    def where(self, key: str) -> str:
        return f"s3://b/{key}"

    async def call(self, op: str, key: str, method: str, nbytes: int = 0, **kw: Any) -> Any:
        return {"create_multipart_upload": {"UploadId": "u"}, "upload_part": {"ETag": '"p"'},
                "complete_multipart_upload": {"ETag": ""}, "head_object": self.head}[method]

    async def put_object(self, op: str, key: str, data: bytes | memoryview, **extra: Any) -> str:
        raise AssertionError("a multipart blob")

    async def abort_upload(self, key: str, upload_id: str) -> None:
        self.aborted = True


#: the composite CRC32 of three parts of SMALL_PART bytes b"x" (what S3 and moto report)
_X3 = composite_crc32([crc32_b64(b"x" * SMALL_PART)] * 3)


@pytest.mark.parametrize("head", [
    {"ETag": '"e-3"', "ContentLength": 3 * SMALL_PART - 1},
    {"ETag": "", "ContentLength": 3 * SMALL_PART},
    {"ETag": '"e-3"', "ContentLength": 3 * SMALL_PART, "ChecksumCRC32": "AAAAAA==-3"},
    {"ETag": '"e-3"', "ContentLength": 3 * SMALL_PART, "ChecksumCRC32": f"{_X3}-2"},
])
def test_empty_completion_etag_with_a_wrong_object_fails_the_commit(head: dict[str, Any]) -> None:
    """Size, and the checksum where the server gives one, must be what was sent."""
    s3 = _CompletesWithoutETag(head)

    async def body() -> None:
        w = S3Writer(s3, "k", None)
        await w.write(b"x" * (3 * SMALL_PART))
        with pytest.raises(StorageError, match=r"bytes where|nor did a HEAD|CRC32 is") as info:
            await w.commit()
        assert info.value.errno == errno.EIO and "s3://b/k" in str(info.value)

    asyncio.run(body())
    assert s3.aborted


@pytest.mark.parametrize("checksum", [_X3, f"{_X3}-3", None])
def test_empty_completion_etag_with_the_right_object_commits(checksum: str | None) -> None:
    """The checksum with or without S3's ``-<parts>`` suffix, or none at all (Ceph RGW 16
    returns none: then the size alone is checked)."""
    head: dict[str, Any] = {"ETag": '"e-3"', "ContentLength": 3 * SMALL_PART}
    if checksum is not None:
        head["ChecksumCRC32"] = checksum
    s3 = _CompletesWithoutETag(head)

    async def body() -> None:
        w = S3Writer(s3, "k", None)
        await w.write(b"x" * (3 * SMALL_PART))
        assert await w.commit() == 3 * SMALL_PART

    asyncio.run(body())
    assert not s3.aborted


def test_parts_below_the_servers_minimum_are_refused_clearly(
    s3_server: S3Server, factory: S3Factory
) -> None:
    """A part size under the server's minimum (here a quarter of what the test servers
    accept; S3 and RGW refuse it only at completion) fails the commit with an error naming
    the setting to raise; the upload is aborted and nothing is published."""
    small = SMALL_PART // 4
    f = replace(factory, part_size=small, options={"min_part_size": small})

    async def body(s: S3Store) -> None:
        w = s.open_writer("tiny-parts")
        await w.write(blob(3 * small + 10))
        with pytest.raises(StorageError, match="EntityTooSmall") as info:
            await w.commit()
        assert info.value.errno == errno.EINVAL
        assert f"parts of {small} bytes" in str(info.value) and "part_mib" in str(info.value)
        assert "tiny-parts" in str(info.value)
        assert not await s.exists("tiny-parts")

    run(body, f)
    assert s3_server.uploads(f.prefix) == []


def test_relay_fills_an_empty_completion_etag(s3_server: S3Server, proxy: FaultProxy) -> None:
    """The benchmark's relay (``fill_etag``) gives clients that cannot cope with RGW's empty
    completion ETag the one S3 defines, equal to what a HEAD shows; moto's is kept."""
    proxy.fail(lambda r: r.is_complete, "fill_etag", times=None)
    client = boto3.client("s3", endpoint_url=proxy.endpoint_url, region_name="us-east-1")
    key = f"{s3_server.unique_prefix('relay')}/mp"
    upload = client.create_multipart_upload(Bucket=s3_server.bucket, Key=key)["UploadId"]
    parts = []
    for n in (1, 2):
        resp = client.upload_part(Bucket=s3_server.bucket, Key=key, UploadId=upload,
                                  PartNumber=n, Body=blob(SMALL_PART, n))
        parts.append({"PartNumber": n, "ETag": resp["ETag"]})
    done = client.complete_multipart_upload(Bucket=s3_server.bucket, Key=key, UploadId=upload,
                                            MultipartUpload={"Parts": parts})
    head = s3_server.client.head_object(Bucket=s3_server.bucket, Key=key)
    assert done["ETag"] == head["ETag"] and head["ETag"].endswith('-2"')


@pytest.mark.parametrize("action", ["unquoted_if_match", "rgw_if_match"])
@pytest.mark.parametrize("name", ["test_put_if_match_cas", "test_put_if_match_two_writers_one_wins",
                                  "test_put_if_match_counter_is_linearizable"])
def test_cas_on_a_server_comparing_if_match_unquoted(
    factory: S3Factory, proxy: FaultProxy, name: str, action: str
) -> None:
    """The conformance suite's compare-and-swap tests, the linearizable counter included,
    through a server that compares If-Match without quotes (and, for ``rgw_if_match``,
    answers 412 on a missing key): every write lands, none is lost, stale ETags still fail."""
    quirk = proxy.fail(IF_MATCH_PUT, action, times=None)
    getattr(TestS3Store(), name)(via_proxy(factory, proxy))
    assert quirk.hits > 0
    sent = [r.headers["if-match"] for r in proxy.log if IF_MATCH_PUT(r)]
    assert any(not v.startswith('"') for v in sent)  # the unquoted form was learnt


def test_wrong_etag_never_matches_in_either_form(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy)
    quirk = proxy.fail(IF_MATCH_PUT, "rgw_if_match", times=None)

    async def body(s: S3Store) -> None:
        await s.put("alias", b"v0")
        _, tag = await s.get_with_etag("alias")
        tag1 = await s.put_if_match("alias", b"v1", tag)  # learns the unquoted form
        for stale in (tag, tag.strip('"'), '"0123"', "0123"):
            with pytest.raises(PreconditionFailed):
                await s.put_if_match("alias", b"stale", stale)
        assert await s.get_with_etag("alias") == (b"v1", tag1)
        assert await s.put_if_match("alias", b"v2", tag1.strip('"'))  # either form we hold

    run(body, f)
    assert quirk.hits >= 6


@pytest.mark.parametrize("action", ["missing_412", "pass"])
def test_if_match_on_a_missing_key_fails_whether_412_or_404(
    factory: S3Factory, proxy: FaultProxy, action: str
) -> None:
    f = via_proxy(factory, proxy)
    quirk = proxy.fail(IF_MATCH_PUT, action, times=None)

    async def body(s: S3Store) -> None:
        await s.put("there", b"x")
        _, tag = await s.get_with_etag("there")
        with pytest.raises(PreconditionFailed):
            await s.put_if_match("missing", b"y", tag)
        assert not await s.exists("missing")

    run(body, f)
    assert quirk.hits >= 1


# -- injected faults --------------------------------------------------------------------------
def test_part_failing_once_is_retried(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy)
    data = blob(3 * f.part_size + 5)
    fault = proxy.fail(lambda r: r.is_upload_part and r.query["partNumber"] == ["2"], "500")
    reset = proxy.fail(lambda r: r.is_upload_part and r.query["partNumber"] == ["3"], "reset")

    async def body(s: S3Store) -> None:
        w = s.open_writer("retry")
        await w.write(data)
        await w.commit()
        assert await s.get("retry") == data

    run(body, f)
    assert fault.hits == 1 and reset.hits == 1
    tries = [r.query["partNumber"][0] for r in proxy.log if r.is_upload_part]
    assert sorted(tries) == ["1", "2", "2", "3", "3", "4"]


def test_part_failing_always_aborts_the_upload(
    s3_server: S3Server, factory: S3Factory, proxy: FaultProxy
) -> None:
    f = via_proxy(factory, proxy, max_attempts=2)
    proxy.fail(lambda r: r.is_upload_part and r.query["partNumber"] == ["2"], "503", times=None)

    async def body(s: S3Store) -> None:
        w = s.open_writer("doomed")
        with pytest.raises(StorageError) as info:
            for _ in range(6):
                await w.write(blob(f.part_size))
            await w.commit()
        message = str(info.value)
        assert s3_server.bucket in message and f"{f.prefix}/doomed" in message
        assert "SlowDown" in message
        await w.abort()  # idempotent after the automatic abort

    run(body, f)
    assert [r.query["partNumber"][0] for r in proxy.log if r.is_upload_part].count("2") == 2
    assert s3_server.uploads(f.prefix) == []
    assert s3_server.objects(f.prefix) == []


def test_complete_200_with_error_body(
    s3_server: S3Server, factory: S3Factory, proxy: FaultProxy
) -> None:
    f = via_proxy(factory, proxy, max_attempts=2)
    data = blob(2 * f.part_size + 1)

    async def body(s: S3Store) -> None:
        once = proxy.fail(lambda r: r.is_complete, "200error", times=1)
        w = s.open_writer("ok")
        await w.write(data)
        await w.commit()  # botocore turns the 200-with-error into a retried 500
        assert once.hits == 1
        assert await s.get("ok") == data
        proxy.fail(lambda r: r.is_complete, "200error", times=None)
        w = s.open_writer("bad")
        await w.write(data)
        with pytest.raises(StorageError) as info:
            await w.commit()
        assert "InternalError" in str(info.value) and "bad" in str(info.value)
        assert not await s.exists("bad")

    run(body, f)
    assert s3_server.uploads(f.prefix) == []


def test_transient_put_and_get_errors_are_retried(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy)
    slow = proxy.fail(lambda r: r.method == "PUT" and not r.query, "503", times=1)
    reset = proxy.fail(lambda r: r.method == "GET" and "range" in r.headers, "reset", times=1)

    async def body(s: S3Store) -> None:
        await s.put("k", b"value")
        assert await s.get("k") == b"value"

    run(body, f)
    assert slow.hits == 1 and reset.hits == 1


def test_body_cut_mid_stream_is_retried(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy)
    data = blob(3 * f.part_size)
    cut = proxy.fail(lambda r: r.method == "GET" and "bytes=0-" not in r.headers.get("range", ""),
                     "truncate", times=2)

    async def body(s: S3Store) -> None:
        await s.put("k", data)
        assert await s.get("k") == data

    run(body, f)
    assert cut.hits == 2


def test_timeouts_are_retried(factory: S3Factory, proxy: FaultProxy) -> None:
    """The first PUT is never answered while the test runs: the put can only succeed if
    the client's read timeout fires and the request is retried."""
    f = via_proxy(factory, proxy, options={"read_timeout": 0.5})
    stall = proxy.fail(lambda r: r.method == "PUT", "hold", times=1)

    async def body(s: S3Store) -> None:
        await s.put("k", b"value")
        assert not stall.released.is_set()  # still unanswered: the retry did it
        assert await s.get("k") == b"value"

    try:
        run(body, f)
    finally:
        stall.released.set()
    assert stall.hits == 1
    assert len([r for r in proxy.log if r.method == "PUT"]) == 2


def test_watchdog_gives_up_on_a_hung_request(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy, max_attempts=1)
    proxy.fail(lambda r: r.method == "PUT", "stall", times=None)

    async def body(s: S3Store) -> None:
        s.watchdog = lambda nbytes: 0.3  # type: ignore[method-assign]
        with pytest.raises(StorageError) as info:
            await s.put("hung", b"x")
        assert info.value.errno == errno.ETIMEDOUT and "hung" in str(info.value)

    run(body, f)


def test_permanent_errors_name_bucket_and_key(factory: S3Factory, proxy: FaultProxy) -> None:
    f = via_proxy(factory, proxy, max_attempts=2)
    proxy.fail(lambda r: r.method == "GET", "500", times=None)

    async def body(s: S3Store) -> None:
        with pytest.raises(StorageError) as info:
            await s.get("some/key")
        assert f"s3://{f.server.bucket}/{f.prefix}/some/key" in str(info.value)
        assert not isinstance(info.value, KeyNotFound)

    run(body, f)


def _start_orphan(bucket: str, prefix: str, endpoint: str, ready: Any) -> None:
    """Child process: start a multipart upload, report, then hang until SIGKILLed."""

    async def main() -> None:
        store = S3Store(
            bucket, prefix, endpoint_url=endpoint, part_size=SMALL_PART, min_part_size=SMALL_PART
        )
        w = store.open_writer("orphan/blob")
        await w.write(blob(3 * SMALL_PART))
        while len(w._parts) < 2:
            await asyncio.sleep(0.01)
        ready.set()
        await asyncio.sleep(3600)

    asyncio.run(main())


def test_killed_process_leaves_an_orphan_that_cleanup_aborts(
    s3_server: S3Server, factory: S3Factory
) -> None:
    ctx = multiprocessing.get_context("fork")  # no re-import of torch in the child
    ready = ctx.Event()
    args = (s3_server.bucket, factory.prefix, s3_server.endpoint_url, ready)
    child = ctx.Process(target=_start_orphan, args=args)
    child.start()
    try:
        assert ready.wait(30), "child never started its upload"
    finally:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(10)
    assert child.exitcode == -signal.SIGKILL
    assert [u["Key"] for u in s3_server.uploads(factory.prefix)] == [
        f"{factory.prefix}/orphan/blob"
    ]

    async def body(s: S3Store) -> None:
        assert await s.cleanup_incomplete("other/") == 0
        assert await s.cleanup_incomplete("") == 1
        assert await s.list("") == []

    run(body, factory)
    assert s3_server.uploads(factory.prefix) == []


def test_open_store_s3(s3_server: S3Server) -> None:
    store = open_store(
        "s3://mithril-test/some/prefix", endpoint_url=s3_server.endpoint_url, max_attempts=2
    )
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.max_attempts) == ("mithril-test", "some/prefix", 2)
    remote = RemoteConfig(bucket="bkt", prefix="runs", part_mib=16, max_concurrency=3)
    store = open_store(remote)
    assert isinstance(store, S3Store)
    assert (store.part_size, store.max_concurrency) == (16 << 20, 3)
    with pytest.raises(ValueError):
        open_store("s3://bkt/p", bogus=1)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_store_survives_successive_event_loops(factory: S3Factory) -> None:
    """Each asyncio.run gets a fresh client (the old loop's session is abandoned)."""
    store = factory.new()
    asyncio.run(store.put("k", b"1"))
    _, tag = asyncio.run(store.get_with_etag("k"))
    asyncio.run(store.put_if_match("k", b"2", tag))
    assert asyncio.run(store.get("k")) == b"2"
    asyncio.run(store.close())
