"""``S3Store``: the Store protocol on S3 or an S3-compatible server (see the package doc)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import aioboto3
from botocore.config import Config
from botocore.exceptions import ClientError

from mithril_async.errors import (
    KeyExists,
    KeyNotFound,
    PreconditionFailed,
    StorageError,
    UnsafeKey,
)
from mithril_async.storage.base import (
    RESERVED_PREFIX,
    DirListing,
    Incomplete,
    Leftovers,
    as_bytes,
    check_key,
    check_prefix,
    check_range,
    dir_listing,
    key_in_prefix,
    skipped,
)
from mithril_async.storage.s3.errors import (
    CALL_ERRORS,
    TRANSIENT_STREAM_ERRORS,
    backoff,
    error_code,
    is_missing,
    is_precondition,
)
from mithril_async.storage.s3.writer import MAX_PART_SIZE, MIB, S3Writer, crc32_async

log = logging.getLogger("mithril_async.storage.s3")
T = TypeVar("T")

DEFAULT_PART_SIZE = 8 * MIB
MIN_PART_SIZE = 5 * MIB
WATCHDOG_MIN_RATE = 256 * 1024  # bytes/s below which a request counts as hung
#: parallel reads: ranges per connection (see ``S3Store._read_once``) and the largest range
RANGES_PER_CONNECTION = 4
MAX_RANGE = 128 * MIB
ConditionalMode = Literal["auto", "native", "emulate"]


def range_size(remaining: int, part: int, connections: int) -> int:
    """Bytes per ranged GET for ``remaining`` bytes: about ``RANGES_PER_CONNECTION`` ranges
    per connection, a whole number of parts (at least one), at most ``MAX_RANGE``."""
    want = -(-remaining // (RANGES_PER_CONNECTION * max(1, connections)))
    return max(part, min(MAX_RANGE, -(-want // part) * part))


class S3Store:
    """S3-backed store; see the module docstring for guarantees and knobs."""

    #: every read is a request over the network: a restore reads each blob once (decoded into
    #: fresh tensors) rather than the local stores' verify-then-decode-in-place two passes
    remote_reads = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = 8,
        max_attempts: int = 5,
        conditional_writes: ConditionalMode = "auto",
        min_part_size: int = MIN_PART_SIZE,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        addressing_style: Literal["auto", "path", "virtual"] | None = None,
        session: aioboto3.Session | None = None,
    ) -> None:
        """``min_part_size`` may only be lowered for test servers that accept smaller parts
        (moto's ``S3_UPLOAD_PART_MIN_SIZE``); real S3 refuses parts below 5 MiB."""
        if not bucket:
            raise ValueError("S3Store needs a bucket name")
        if not min_part_size <= part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"part_size {part_size} outside [{min_part_size}, {MAX_PART_SIZE}] bytes"
            )
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be >= 1")
        if conditional_writes not in ("auto", "native", "emulate"):
            raise ValueError(f"conditional_writes: auto/native/emulate, not {conditional_writes}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.url = f"s3://{bucket}/{self.prefix + '/' if self.prefix else ''}"
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.conditional_writes: ConditionalMode = conditional_writes
        self.atomic_conditional_writes = conditional_writes != "emulate"
        self._session = session or aioboto3.Session()
        style = addressing_style or ("path" if endpoint_url else "auto")
        self._config = Config(
            region_name=region_name,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max(10, 2 * max_concurrency),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            s3={"addressing_style": style},
        )
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._client_lock = asyncio.Lock()
        self._probe_lock = asyncio.Lock()
        self._warned_emulation = False
        #: how this server wants If-Match: S3 and moto quoted, Ceph RGW unquoted (learnt)
        self._if_match_form: Literal["quoted", "unquoted"] = "quoted"

    # -- plumbing --------------------------------------------------------------------------
    async def client(self) -> Any:
        """The aiobotocore S3 client, created on first use inside the running loop.

        A client (its aiohttp session) belongs to one event loop; if the store is used from
        a new loop (e.g. successive ``asyncio.run`` calls) a fresh client is made there.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._client, self._stack = None, None  # the old loop's client cannot run here
            self._client_lock, self._probe_lock = asyncio.Lock(), asyncio.Lock()
        if self._client is None:
            async with self._client_lock:
                if self._client is None:
                    stack = contextlib.AsyncExitStack()
                    self._client = await stack.enter_async_context(
                        self._session.client(
                            "s3",
                            endpoint_url=self.endpoint_url,
                            region_name=self.region_name,
                            config=self._config,
                        )
                    )
                    self._client.meta.events.register("before-send.s3", _drop_expect_continue)
                    self._stack = stack
        return self._client

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> S3Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def full_key(self, key: str) -> str:
        """The object key of a store key (validated)."""
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str | None:
        if not self.prefix:
            return full
        head = self.prefix + "/"
        return full[len(head) :] if full.startswith(head) else None

    def _list_prefix(self, norm: str) -> str:
        """The S3 string prefix covering a normalised store prefix (filtered afterwards)."""
        if norm:
            return self.full_key(norm)
        return f"{self.prefix}/" if self.prefix else ""

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{key}"

    def error(self, exc: BaseException, op: str, key: str) -> StorageError:
        """Map a botocore/aiohttp failure to a typed error naming bucket and key."""
        where = self.where(key)
        if is_missing(exc):
            return KeyNotFound(errno.ENOENT, f"{op}: key {key!r} not found", where)
        code, status = error_code(exc)
        if code:
            msg = exc.response.get("Error", {}).get("Message", "")  # type: ignore[attr-defined]
            detail = f"{code} (HTTP {status}) {msg}".strip()
            num = errno.EACCES if status == 403 else errno.EIO
        else:
            detail = f"{type(exc).__name__}: {exc}"
            num = getattr(exc, "errno", None) or errno.EIO
        return StorageError(num, f"{op} failed after retries: {detail}", where)

    def watchdog(self, nbytes: int) -> float:
        """Seconds after which a request (with all of botocore's retries) is given up.

        A safety net, not the retry mechanism: aiohttp has no timeout on *sending* a body, so
        a server that stops reading would otherwise hang a save forever."""
        per_try = self.connect_timeout + self.read_timeout + nbytes / WATCHDOG_MIN_RATE
        return self.max_attempts * per_try + 20.0 * (self.max_attempts - 1)

    async def call(self, op: str, key: str, method: str, nbytes: int = 0, **kwargs: Any) -> Any:
        """Call a client method, mapping every failure through :meth:`error`."""
        client = await self.client()
        deadline = self.watchdog(nbytes)
        try:
            return await asyncio.wait_for(
                getattr(client, method)(Bucket=self.bucket, **kwargs), deadline
            )
        except TimeoutError as exc:
            raise StorageError(
                errno.ETIMEDOUT, f"{op} got no answer within {deadline:.0f} s", self.where(key)
            ) from exc
        except CALL_ERRORS as exc:
            raise self.error(exc, op, key) from exc

    async def _retry_stream(self, op: str, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Retry a request whose *body read* failed transiently (botocore only retries
        until the headers arrive)."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await fn()  # StorageErrors from the request itself: botocore retried
            except TRANSIENT_STREAM_ERRORS as exc:
                if attempt == self.max_attempts:
                    raise self.error(exc, op, key) from exc
            log.debug("retrying %s of %s (attempt %d)", op, self.where(key), attempt + 1)
            await asyncio.sleep(backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- reads -----------------------------------------------------------------------------
    async def _get_once(
        self, op: str, key: str, start: int | None, end: int | None, if_match: str | None
    ) -> tuple[bytes, dict[str, Any]]:
        """One (ranged) GET with its body fully read; ``end`` is inclusive."""
        kwargs: dict[str, Any] = {"Key": self.full_key(key)}
        if start is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end}"
        if if_match is not None:
            kwargs["IfMatch"] = if_match

        async def attempt() -> tuple[bytes, dict[str, Any]]:
            resp = await self.call(op, key, "get_object", **kwargs)
            async with resp["Body"] as body:
                data = await body.read()
            return data, resp

        return await self._retry_stream(op, key, attempt)

    async def _first_range(self, op: str, key: str, start: int, n: int) -> tuple[bytes, str]:
        """GET ``n`` bytes from ``start``; past the end (or on an empty object) that is
        ``b""`` - after a HEAD, so a missing key still raises :class:`KeyNotFound`."""
        try:
            data, resp = await self._get_once(op, key, start, start + n - 1, None)
        except StorageError as exc:
            if error_code(exc.__cause__ or exc)[0] != "InvalidRange":
                raise
            resp = await self.call(op, key, "head_object", Key=self.full_key(key))
            return b"", str(resp.get("ETag", ""))
        return data, str(resp.get("ETag", ""))

    async def _read(self, op: str, key: str, start: int, length: int | None) -> tuple[bytes, str]:
        """Read ``length`` bytes (``None``: to the end) from ``start``; returns (data, etag)."""
        for _attempt in range(self.max_attempts):
            result = await self._read_once(op, key, start, length)
            if result is not None:
                return result
            log.debug("%s changed during a parallel read; restarting", self.where(key))
        raise StorageError(
            errno.EAGAIN, f"{op}: object kept changing during the read", self.where(key)
        )

    async def _read_once(
        self, op: str, key: str, start: int, length: int | None
    ) -> tuple[bytes, str] | None:
        """One try of :meth:`_read`; ``None`` when the object was replaced meanwhile.

        The first part-sized range is fetched at once. When the read may span more than one
        range, a HEAD runs beside it: its size lets the remaining ranges start without
        waiting for the first one, and its ETag pins them (``IfMatch``) to one version.
        The rest is cut into about ``RANGES_PER_CONNECTION`` ranges per connection (at least
        a part, at most ``MAX_RANGE``): each request has a fixed cost (latency, a request fee;
        on moto a copy of the whole object, so small ranges of a big object crawl), while
        several ranges per connection keep one slow range from holding up the others.
        """
        chunk = self.part_size
        first_len = chunk if length is None else min(chunk, length)
        # every request of this read, the first range and the HEAD included, takes a slot
        sem = asyncio.Semaphore(self.max_concurrency)

        async def limited(request: Callable[[], Awaitable[T]]) -> T:
            async with sem:  # the coroutine is made only here: a cancelled task leaves none
                return await request()

        first = asyncio.ensure_future(
            limited(lambda: self._first_range(op, key, start, first_len))
        )
        tasks: list[asyncio.Future[Any]] = [first]
        try:
            if length is not None and length <= chunk:
                return await first
            head = asyncio.ensure_future(
                limited(lambda: self.call(op, key, "head_object", Key=self.full_key(key)))
            )
            tasks.append(head)
            try:
                meta = await head
            except StorageError:
                # a HEAD error has no body (404 could be NoSuchKey or NoSuchBucket): report
                # the GET's precise error where there is one
                await first
                raise
            etag, total = str(meta.get("ETag", "")), int(meta["ContentLength"])
            stop = total if length is None else min(total, start + length)
            if start >= stop:
                return b"", etag
            step = range_size(stop - start - first_len, chunk, self.max_concurrency)

            async def fetch(off: int) -> bytes:
                async with sem:
                    data, _ = await self._get_once(op, key, off, min(off + step, stop) - 1, etag)
                    return data

            rest = [asyncio.ensure_future(fetch(o)) for o in range(start + first_len, stop, step)]
            tasks += rest
            data, first_etag = await first
            if first_etag != etag:
                return None
            pieces = [data, *await asyncio.gather(*rest)]
        except StorageError as exc:
            if is_precondition(exc.__cause__ or exc):
                return None
            raise
        finally:  # on any exit stop what is still running and collect every outcome
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if stop - start > 4 * chunk:  # a big memcpy: keep it off the event loop
            return await asyncio.to_thread(b"".join, pieces), etag
        return b"".join(pieces), etag

    async def get(self, key: str) -> bytes:
        return (await self._read("get", key, 0, None))[0]

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return await self._read("get_with_etag", key, 0, None)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        if length == 0:
            await self.size(key)  # still report a missing key
            return b""
        return (await self._read("get_range", key, start, length))[0]

    async def size(self, key: str) -> int:
        resp = await self.call("size", key, "head_object", Key=self.full_key(key))
        return int(resp["ContentLength"])

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except KeyNotFound:
            return False
        return True

    async def _pages(
        self, op: str, norm: str, method: str, **kwargs: Any
    ) -> builtins.list[dict[str, Any]]:
        """Every page of a paginated listing ``method`` (``Bucket`` filled in)."""
        client = await self.client()
        try:
            paginator = client.get_paginator(method).paginate(Bucket=self.bucket, **kwargs)
            return [page async for page in paginator]
        except CALL_ERRORS as exc:
            raise self.error(exc, op, norm) from exc

    async def list(self, prefix: str) -> list[str]:
        return sorted(key for key, _ in await self._objects(check_prefix(prefix)))

    async def _objects(self, norm: str) -> builtins.list[tuple[str, int]]:
        """(key, size) of every object under the normalised prefix ``norm`` that is a key."""
        out = []
        pages = await self._pages("list", norm, "list_objects_v2", Prefix=self._list_prefix(norm))
        for page in pages:
            for obj in page.get("Contents", []):
                rel = self._rel(obj["Key"])
                if rel is None or not key_in_prefix(rel, norm):
                    continue
                with contextlib.suppress(UnsafeKey):
                    out.append((check_key(rel), int(obj["Size"])))
        return out

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` with its size, from the listing's own ``Size``
        (:class:`~mithril_async.storage.capabilities.SizedListing`)."""
        return dict(sorted(await self._objects(check_prefix(prefix))))

    async def list_dir(self, prefix: str) -> DirListing:
        """One delimited listing: the keys directly in the folder and its common prefixes.

        A common prefix shows where any object lies below it, so objects written by other
        tools under names no key can have still make their folder appear."""
        norm = check_prefix(prefix)
        head = self._list_prefix(norm) + ("/" if norm else "")
        pages = await self._pages(
            "list_dir", norm, "list_objects_v2", Prefix=head, Delimiter="/"
        )
        rels = [obj["Key"][len(head) :] for page in pages for obj in page.get("Contents", [])]
        rels += [p["Prefix"][len(head) :] for page in pages for p in page.get("CommonPrefixes", [])]
        return dir_listing(rels)

    # -- writes ----------------------------------------------------------------------------
    async def put_object(self, op: str, key: str, data: bytes | memoryview, **extra: Any) -> str:
        """One PutObject of ``key`` with a CRC32 the server verifies, ``extra`` added to the
        request (e.g. ``IfNoneMatch="*"``); returns the new ETag. Errors as :meth:`call`."""
        body = as_bytes(data)
        resp = await self.call(
            op,
            key,
            "put_object",
            nbytes=len(body),
            Key=self.full_key(key),
            Body=body,
            ChecksumAlgorithm="CRC32",
            ChecksumCRC32=await crc32_async(body),
            **extra,
        )
        return str(resp.get("ETag", ""))

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.put_object("put", key, data)

    async def delete(self, key: str) -> None:
        await self.call("delete", key, "delete_object", Key=self.full_key(key))

    async def detect_conditional_writes(self) -> bool:
        """Probe (once) whether the server honours both conditions on PutObject: of an
        object that exists, a PUT with ``If-None-Match: *`` and one with an ``If-Match``
        naming an ETag it does not have must both be refused (412). A server honouring only
        the first would be trusted with the aliases' compare-and-swap and overwrite them
        blindly. Sets and returns :attr:`atomic_conditional_writes`."""
        await self.client()  # (re)binds the locks to the running loop
        async with self._probe_lock:
            if self.conditional_writes != "auto":
                return self.atomic_conditional_writes
            probe = f"{RESERVED_PREFIX}probe-{secrets.token_hex(6)}"
            full = f"{self.prefix}/{probe}" if self.prefix else probe
            client = await self.client()
            try:
                await client.put_object(Bucket=self.bucket, Key=full, Body=b"")
                honoured = (await self._refuses(client, full, "If-None-Match", IfNoneMatch="*")
                            and await self._refuses(client, full, "If-Match",
                                                    IfMatch=f'"{secrets.token_hex(16)}"'))
            except CALL_ERRORS as exc:
                raise self.error(exc, "detect_conditional_writes", probe) from exc
            finally:
                with contextlib.suppress(*CALL_ERRORS):
                    await client.delete_object(Bucket=self.bucket, Key=full)
            self.conditional_writes = "native" if honoured else "emulate"
            self.atomic_conditional_writes = honoured
            return honoured

    async def _refuses(self, client: Any, full: str, header: str, **condition: str) -> bool:
        """Whether the server refuses (412, 409) a PutObject of the existing probe object
        whose ``header`` condition does not hold, i.e. honours that header."""
        try:
            await client.put_object(Bucket=self.bucket, Key=full, Body=b"", **condition)
        except ClientError as exc:
            if is_precondition(exc):
                return True
            log.info("conditional PutObject (%s) refused by %s: %s", header, self.url, exc)
            return False
        log.warning("%s ignores %s on PutObject: a PUT whose condition fails was stored",
                    self.url, header)
        return False

    async def _native(self) -> bool:
        if self.conditional_writes == "auto":
            await self.detect_conditional_writes()
        if self.conditional_writes == "emulate" and not self._warned_emulation:
            self._warned_emulation = True
            log.warning(
                "%s: server does not honour conditional PutObject (If-None-Match and If-Match); "
                "put_if_absent/put_if_match fall back to a NON-ATOMIC read-compare-write "
                "(concurrent writers can both win)",
                self.url,
            )
        return self.conditional_writes == "native"

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        self.full_key(key)
        if await self._native():
            try:
                await self.put_object("put_if_absent", key, data, IfNoneMatch="*")
            except StorageError as exc:
                if is_precondition(exc.__cause__ or exc):
                    raise KeyExists(errno.EEXIST, "key already exists", self.where(key)) from exc
                raise
            return
        if await self.exists(key):
            raise KeyExists(errno.EEXIST, "key already exists", self.where(key))
        await self.put_object("put_if_absent", key, data)

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        self.full_key(key)

        def lost(found: str | None) -> PreconditionFailed:
            return PreconditionFailed(
                errno.EAGAIN,
                f"conditional write lost: expected etag {etag!r}, found {found!r}",
                self.where(key),
            )

        if await self._native():
            if etag is None:
                try:
                    tag = await self.put_object("put_if_match", key, data, IfNoneMatch="*")
                except StorageError as exc:
                    if is_precondition(exc.__cause__ or exc):
                        raise lost("<changed>") from exc
                    raise
                return await self._own_tag(key, data, tag)
            return await self._put_matching(key, data, etag, lost)
        try:
            head = await self.call("put_if_match", key, "head_object", Key=self.full_key(key))
            current: str | None = str(head.get("ETag", ""))
        except KeyNotFound:
            current = None
        if current != etag:
            raise lost(current)
        return await self._own_tag(key, data, await self.put_object("put_if_match", key, data))

    async def _own_tag(self, key: str, data: bytes | memoryview, tag: str) -> str:
        """The ETag of what a successful conditional write stored: the PUT's answer, or,
        where that answer carried none (a server or relay that leaves it out or blank), the
        object's ETag read back if the object still holds ``data``. If another writer has
        replaced it already, ``""``: no object's ETag equals it, so a compare-and-swap with
        it fails, as it must."""
        if tag.strip('"'):
            return tag
        try:
            stored, current = await self.get_with_etag(key)
        except KeyNotFound:
            return ""
        if current.strip('"') and stored == as_bytes(data):
            return current
        return ""

    async def _put_if_match_form(self, key: str, data: bytes | memoryview, value: str
                                 ) -> str | None:
        """One PutObject with ``If-Match: value``: the answer's ETag once stored (possibly
        empty: see :meth:`_own_tag`); None when the precondition failed or the key is
        missing (S3 and moto answer 404 there, Ceph RGW 412: both mean "not there")."""
        try:
            return await self.put_object("put_if_match", key, data, IfMatch=value)
        except StorageError as exc:
            cause = exc.__cause__ or exc
            if is_precondition(cause) or is_missing(cause):
                return None
            raise

    async def _put_matching(
        self,
        key: str,
        data: bytes | memoryview,
        etag: str,
        lost: Callable[[str | None], PreconditionFailed],
    ) -> str:
        """``put_if_match`` with an ETag, on a server that compares ``If-Match`` with the
        ETag quoted (S3, moto) or unquoted (Ceph RGW): the form last seen to work is sent
        first; on a 412 the other form is tried once, and only when a HEAD shows the object's
        ETag equal to ``etag`` modulo quotes. The server still compares every write, so a
        wrong ETag never matches in either form."""
        bare = etag.strip('"')
        forms = {"quoted": f'"{bare}"', "unquoted": bare}
        first = self._if_match_form
        new_tag = await self._put_if_match_form(key, data, forms[first])
        if new_tag is not None:
            return await self._own_tag(key, data, new_tag)
        try:
            head = await self.call("put_if_match", key, "head_object", Key=self.full_key(key))
        except KeyNotFound:
            raise lost(None) from None
        current = str(head.get("ETag", ""))
        if current.strip('"') != bare:
            raise lost(current)
        other: Literal["quoted", "unquoted"] = "unquoted" if first == "quoted" else "quoted"
        new_tag = await self._put_if_match_form(key, data, forms[other])
        if new_tag is None:
            raise lost("<changed>")
        if self._if_match_form != other:
            log.info("%s compares If-Match %s; sending it so from now on", self.url, other)
            self._if_match_form = other
        return await self._own_tag(key, data, new_tag)

    def open_writer(self, key: str, size_hint: int | None = None) -> S3Writer:
        """Stream ``key`` as a multipart upload; ``size_hint`` (bytes) only picks a larger
        initial part size for huge blobs."""
        return S3Writer(self, key, size_hint)

    async def _uploads(self, prefix: str) -> builtins.list[tuple[str, str, datetime]]:
        """(key, upload id, initiated) of multipart uploads under ``prefix``."""
        norm = check_prefix(prefix)
        found: builtins.list[tuple[str, str, datetime]] = []
        pages = await self._pages(
            "cleanup_incomplete", norm, "list_multipart_uploads", Prefix=self._list_prefix(norm)
        )
        for page in pages:
            for up in page.get("Uploads", []):
                rel = self._rel(up["Key"])
                if rel is not None and key_in_prefix(rel, norm):
                    initiated = up["Initiated"]
                    if initiated.tzinfo is None:
                        initiated = initiated.replace(tzinfo=UTC)
                    found.append((rel, up["UploadId"], initiated))
        return found

    async def list_incomplete(self, prefix: str) -> Leftovers:
        """Multipart uploads under ``prefix``, aged by their ``Initiated`` time (which does
        not advance while parts arrive: a long upload looks old however alive it is)."""
        now = datetime.now(UTC)
        return sorted(Incomplete(key, (now - initiated).total_seconds())
                      for key, _id, initiated in await self._uploads(prefix))

    async def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; an upload that is already gone is not an error."""
        full = f"{self.prefix}/{key}" if self.prefix else key
        try:
            await self.call("abort", key, "abort_multipart_upload", Key=full, UploadId=upload_id)
        except StorageError as exc:
            code, status = error_code(exc.__cause__ or exc)
            if code != "NoSuchUpload" and status != 404:
                raise

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        """Abort multipart uploads under ``prefix`` started ``older_than`` seconds ago or
        earlier (orphans of killed processes), except those under a ``skip`` prefix (live
        saves: an upload's start time says nothing about whether its writer is alive)."""
        now = datetime.now(UTC)
        removed = 0
        for key, upload_id, initiated in await self._uploads(prefix):
            if (now - initiated).total_seconds() < older_than or skipped(key, skip):
                continue
            await self.abort_upload(key, upload_id)
            log.info("aborted incomplete multipart upload %s of %s", upload_id, self.where(key))
            removed += 1
        return removed


def _drop_expect_continue(request: Any, **_: Any) -> None:
    """botocore asks for ``Expect: 100-continue`` on PUTs; aiohttp then waits for the
    server's go-ahead with *no* timeout, so a stalled server hangs the upload. Without it the
    body is sent at once and the read timeout covers the wait for the answer (and one round
    trip per part is saved). The header is not signed, so removing it is safe."""
    if "Expect" in request.headers:
        del request.headers["Expect"]


__all__ = ["DEFAULT_PART_SIZE", "MAX_RANGE", "MIN_PART_SIZE", "S3Store", "range_size"]
