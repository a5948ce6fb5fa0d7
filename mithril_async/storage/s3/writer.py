"""Streaming multipart upload of one S3 key (:class:`S3Writer`), used by ``S3Store``.

Parts are uploaded while the caller keeps writing, at most ``max_concurrency`` at a time, so
memory stays at about ``(max_concurrency + 2) * part_size``; a blob smaller than one part
becomes a single PUT at commit. The part size doubles every 900 parts (capped at 5 GiB), so
a blob never hits S3's 10,000-part limit below S3's 5 TiB object limit (:func:`part_size_for`,
:func:`part_size_at`). Every part carries a CRC32 (``x-amz-checksum-crc32``, computed on a
worker thread) that servers implementing it (AWS S3) verify on receipt; moto and Ceph RGW do
not, which is why the manifest's own per-chunk and per-blob hashes are checked on every read.

The writer sends its requests through :class:`S3Requests` (which ``S3Store`` implements), so
it knows nothing of the store beyond that small interface and this module imports nothing
from the store's.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import logging
import zlib
from typing import Any, Literal, Protocol

from mithril_async.errors import StorageError
from mithril_async.storage.base import WriterContext
from mithril_async.storage.s3.errors import error_code

log = logging.getLogger("mithril_async.storage.s3")

MIB = 1 << 20
MAX_PART_SIZE = 5 * 1024 * MIB
MAX_PARTS = 10_000
#: the largest object S3 stores (5 TiB); 10,000 parts of the growing size always cover it
MAX_OBJECT_SIZE = 5 * 1024**4
#: the part size doubles after every this many parts (900: from S3's 5 MiB minimum part,
#: 10,000 parts hold over 9 TiB; 1,000 would stop short of 5 TiB)
PARTS_PER_SIZE_STEP = 900


def part_size_for(total_bytes: int | None, configured: int) -> int:
    """The size of the first part of a blob of ``total_bytes`` (``None``: unknown).

    The configured size, or more when that would take over ``MAX_PARTS`` parts for a known
    total (rounded up to a whole MiB), never over ``MAX_PART_SIZE``. Later parts grow
    (:func:`part_size_at`), so an unknown or understated total still fits."""
    base = configured
    if total_bytes:
        base = max(base, -(-total_bytes // MAX_PARTS // MIB) * MIB)
    return min(base, MAX_PART_SIZE)


def part_size_at(first: int, number: int) -> int:
    """The size of part ``number`` (from 1) when part 1 has ``first`` bytes: doubled after
    every ``PARTS_PER_SIZE_STEP`` parts, capped at ``MAX_PART_SIZE``."""
    return min(MAX_PART_SIZE, first * 2 ** ((number - 1) // PARTS_PER_SIZE_STEP))


def max_blob_size(first: int) -> int:
    """The most bytes ``MAX_PARTS`` parts hold when part 1 has ``first`` bytes."""
    total = 0
    for start in range(1, MAX_PARTS + 1, PARTS_PER_SIZE_STEP):
        count = min(PARTS_PER_SIZE_STEP, MAX_PARTS + 1 - start)
        total += count * part_size_at(first, start)
    return total


def crc32_b64(data: bytes | bytearray | memoryview) -> str:
    """The base64 big-endian CRC32 S3 expects in ``x-amz-checksum-crc32``."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode("ascii")


def composite_crc32(part_checksums: list[str]) -> str:
    """S3's checksum of a multipart object made with CRC32 (``COMPOSITE``, the default): the
    CRC32 of the parts' binary CRC32s one after the other, base64 (S3 appends ``-<parts>``)."""
    joined = b"".join(base64.b64decode(c) for c in part_checksums)
    return crc32_b64(joined)


async def crc32_async(data: bytes | bytearray | memoryview) -> str:
    """CRC32 off the event loop for anything bigger than a few pages."""
    if len(data) < 256 * 1024:
        return crc32_b64(data)
    return await asyncio.to_thread(crc32_b64, data)


class S3Requests(Protocol):
    """The requests an :class:`S3Writer` sends, with their retries and error mapping."""

    #: the initial part size in bytes
    part_size: int
    #: how many parts may upload at once
    max_concurrency: int

    def full_key(self, key: str) -> str:
        """The object key of a store key (validated)."""

    def where(self, key: str) -> str:
        """``s3://bucket/prefix/key``, for error messages."""

    async def call(self, op: str, key: str, method: str, nbytes: int = 0, **kwargs: Any) -> Any:
        """Call the S3 client's ``method`` (``Bucket`` filled in); failures become
        :class:`StorageError` naming ``op`` and ``key``."""

    async def put_object(self, op: str, key: str, data: bytes | memoryview,
                         **extra: Any) -> str:
        """One PutObject of ``key`` with a CRC32; returns its ETag."""

    async def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload; one already gone is not an error."""


class S3Writer(WriterContext):
    """Streaming multipart upload of one key; see the module docstring.

    A failure of any part (after botocore's retries) aborts the whole upload and is raised
    by the next :meth:`write` or by :meth:`commit`. Cancellation is safe: :meth:`abort`
    waits for an in-flight CreateMultipartUpload so its upload id is never lost.
    """

    def __init__(self, s3: S3Requests, key: str, size_hint: int | None) -> None:
        self.key = key
        self._s3 = s3
        self._full = s3.full_key(key)
        self._base_part = part_size_for(size_hint, s3.part_size)
        self._buf = bytearray(self._part_size(1))  # zero pages are not touched until written
        self._fill = 0
        self._size = 0
        self._parts_started = 0
        self._parts: dict[int, dict[str, Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(s3.max_concurrency)
        self._create: asyncio.Task[str] | None = None
        self._upload_id: str | None = None
        self._failure: BaseException | None = None
        self._state: Literal["open", "committed", "aborted"] = "open"

    @property
    def upload_id(self) -> str | None:
        """The multipart upload id once one has been started (tests and diagnostics)."""
        return self._upload_id

    def _part_size(self, number: int) -> int:
        return part_size_at(self._base_part, number)

    def _check_open(self, op: str) -> None:
        if self._state != "open":
            raise StorageError(
                errno.EINVAL, f"{op} on a {self._state} writer", self._s3.where(self.key)
            )

    async def _fail_if_part_failed(self) -> None:
        if self._failure is not None:
            failure = self._failure
            await self.abort()
            raise failure

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open("write")
        await self._fail_if_part_failed()
        view = memoryview(data).cast("B")
        while view:
            take = min(len(self._buf) - self._fill, len(view))
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            self._size += take
            view = view[take:]
            if self._fill == len(self._buf):
                part, self._fill = self._buf, 0
                self._buf = bytearray(self._part_size(self._parts_started + 2))
                try:
                    await self._submit(part)
                except Exception:
                    await self.abort()
                    raise

    async def _start_upload(self) -> str:
        resp = await self._s3.call(
            "open_writer",
            self.key,
            "create_multipart_upload",
            Key=self._full,
            ChecksumAlgorithm="CRC32",
        )
        return str(resp["UploadId"])

    async def _submit(self, part: bytes | bytearray) -> None:
        """Start uploading the next part; waits while ``max_concurrency`` are in flight."""
        if self._create is None:
            self._create = asyncio.ensure_future(self._start_upload())
        if self._upload_id is None:
            self._upload_id = await asyncio.shield(self._create)
        number = self._parts_started + 1
        if number > MAX_PARTS:
            raise StorageError(
                errno.EFBIG, f"blob needs more than {MAX_PARTS} parts", self._s3.where(self.key)
            )
        await self._slots.acquire()
        if self._failure is not None:  # an earlier part failed for good: stop uploading
            self._slots.release()
            await self._fail_if_part_failed()
        self._parts_started = number
        task = asyncio.create_task(self._upload_part(number, part, self._upload_id))
        self._tasks.add(task)
        task.add_done_callback(self._part_done)

    def _part_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    async def _upload_part(self, number: int, part: bytes | bytearray, upload_id: str) -> None:
        try:
            crc = await crc32_async(part)
            resp = await self._s3.call(
                "write",
                self.key,
                "upload_part",
                nbytes=len(part),
                Key=self._full,
                UploadId=upload_id,
                PartNumber=number,
                Body=part,
                ChecksumAlgorithm="CRC32",
                ChecksumCRC32=crc,
            )
            self._parts[number] = {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": crc}
        finally:
            self._slots.release()

    async def commit(self) -> int:
        self._check_open("commit")
        try:
            await self._fail_if_part_failed()
            if self._create is None:  # smaller than one part: a single PUT
                await self._s3.put_object("commit", self.key, bytes(self._buf[: self._fill]))
            else:
                if self._fill:
                    await self._submit(bytes(self._buf[: self._fill]))
                self._buf, self._fill = bytearray(), 0
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
                await self._fail_if_part_failed()
                parts = [self._parts[n] for n in range(1, self._parts_started + 1)]
                resp = await self._s3.call(
                    "commit",
                    self.key,
                    "complete_multipart_upload",
                    Key=self._full,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
                if not resp.get("ETag"):
                    await self._check_completed(parts)
        except StorageError as exc:
            await self.abort()
            if error_code(exc.__cause__ or exc)[0] == "EntityTooSmall":
                raise self._too_small() from exc
            raise
        except BaseException:
            await self.abort()
            raise
        self._state = "committed"
        self._buf = bytearray()
        return self._size

    def _too_small(self) -> StorageError:
        """The server refused the parts as too small at completion (``EntityTooSmall``): say
        which size was configured and what to change, rather than pass on a bare code."""
        return StorageError(
            errno.EINVAL,
            f"the server refused parts of {self._base_part} bytes as too small "
            "(EntityTooSmall): raise the part size (S3Store part_size, [checkpointing.remote] "
            "part_mib) to at least the server's minimum part size (AWS S3: 5 MiB; Ceph RGW: "
            "rgw_multipart_min_part_size, 5 MiB by default); the upload was aborted",
            self._s3.where(self.key),
        )

    async def _check_completed(self, parts: list[dict[str, Any]]) -> None:
        """CompleteMultipartUpload answered an empty ``<ETag></ETag>`` (Ceph RGW does, while
        a HEAD right after shows the object): HEAD the object and accept it only if it has an
        ETag, exactly the size we sent and, where the server returns one (moto and AWS S3 do;
        Ceph RGW 16 does not), the CRC32 of the parts we sent; anything else is a failed
        commit (and the manifest's own hashes still cover what a server does not check)."""
        where = self._s3.where(self.key)
        head = await self._s3.call("commit", self.key, "head_object", Key=self._full,
                                   ChecksumMode="ENABLED")
        etag, size = head.get("ETag"), head.get("ContentLength")
        if not etag:
            raise StorageError(
                errno.EIO, "CompleteMultipartUpload returned no ETag, nor did a HEAD", where
            )
        if size != self._size:
            raise StorageError(
                errno.EIO,
                f"completed object has {size} bytes where {self._size} were sent",
                where,
            )
        found = head.get("ChecksumCRC32")
        if found and head.get("ChecksumType", "COMPOSITE") == "COMPOSITE":
            expected = composite_crc32([p["ChecksumCRC32"] for p in parts])
            value, _, count = str(found).partition("-")
            if value != expected or count not in ("", str(len(parts))):
                raise StorageError(
                    errno.EIO,
                    f"completed object's CRC32 is {found} where the {len(parts)} parts sent "
                    f"give {expected}-{len(parts)}",
                    where,
                )
        elif not found:
            log.debug("%s: the server returns no checksum; size checked only", where)
        log.debug("filled the empty completion ETag of %s from a HEAD: %s", where, etag)

    async def abort(self) -> None:
        """Cancel part uploads and abort the multipart upload; never raises (a failed abort
        is logged and left to :meth:`S3Store.cleanup_incomplete`)."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._buf, self._fill = bytearray(), 0
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        if self._create is not None and self._upload_id is None:
            await asyncio.wait([self._create])  # a cancelled write may have left it running
            if not self._create.cancelled() and self._create.exception() is None:
                self._upload_id = self._create.result()
        if self._upload_id is not None:
            try:
                await asyncio.shield(self._s3.abort_upload(self.key, self._upload_id))
            except Exception as exc:
                log.warning(
                    "could not abort multipart upload %s of %s: %s (cleanup_incomplete will)",
                    self._upload_id,
                    self._s3.where(self.key),
                    exc,
                )
