"""``S3Connection``: what every request of an :class:`~mithril_async.storage.s3.S3Store` goes
through - its configuration, one aiobotocore client per event loop, the mapping of store keys
to object keys, typed errors naming ``s3://bucket/key``, the watchdog on every request, retries
of streamed bodies, paginated listings and the checksummed PutObject.

The reads (:mod:`.reads`), conditional writes (:mod:`.conditional`) and the store itself
(:mod:`.store`) build on it, so the plumbing lives in one place.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Self, TypeVar

import aioboto3
from botocore.config import Config

from mithril_async.errors import KeyNotFound, StorageError
from mithril_async.storage.base import as_bytes, check_key
from mithril_async.storage.s3.errors import (
    CALL_ERRORS,
    TRANSIENT_STREAM_ERRORS,
    backoff,
    error_code,
    is_missing,
)
from mithril_async.storage.s3.writer import MAX_PART_SIZE, MIB, crc32_async

log = logging.getLogger("mithril_async.storage.s3")
T = TypeVar("T")

DEFAULT_PART_SIZE = 8 * MIB
MIN_PART_SIZE = 5 * MIB
WATCHDOG_MIN_RATE = 256 * 1024  # bytes/s below which a request counts as hung
ConditionalMode = Literal["auto", "native", "emulate"]


class S3Connection:
    """The configuration and request plumbing of an S3 store (see the module docstring)."""

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

    # -- requests --------------------------------------------------------------------------
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

    async def __aenter__(self) -> Self:
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


def _drop_expect_continue(request: Any, **_: Any) -> None:
    """botocore asks for ``Expect: 100-continue`` on PUTs; aiohttp then waits for the
    server's go-ahead with *no* timeout, so a stalled server hangs the upload. Without it the
    body is sent at once and the read timeout covers the wait for the answer (and one round
    trip per part is saved). The header is not signed, so removing it is safe."""
    if "Expect" in request.headers:
        del request.headers["Expect"]
