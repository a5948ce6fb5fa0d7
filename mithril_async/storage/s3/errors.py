"""How S3 failures are told apart: missing keys, lost conditional writes, transient errors.

Shared by the store and anything else that talks to S3 through it, so every caller reads
botocore's error shapes the same way.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

__all__ = [
    "CALL_ERRORS",
    "TRANSIENT_STREAM_ERRORS",
    "backoff",
    "error_code",
    "is_missing",
    "is_precondition",
]

_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}

#: failures while reading a response body, which botocore does not retry (it retries only
#: until the headers arrive): the store retries these itself
TRANSIENT_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientPayloadError,
    aiohttp.ClientConnectionError,
    asyncio.TimeoutError,
    ConnectionError,
    ResponseStreamingError,
    IncompleteReadError,
    ReadTimeoutError,
    ConnectionClosedError,
)
#: everything a client call can raise once botocore gave up; mapped to typed store errors
CALL_ERRORS: tuple[type[BaseException], ...] = (
    ClientError,
    BotoCoreError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    OSError,
)


def error_code(exc: BaseException) -> tuple[str, int | None]:
    """(S3 error code, HTTP status) of a botocore ClientError, else ("", None)."""
    if not isinstance(exc, ClientError):
        return "", None
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


def is_precondition(exc: BaseException) -> bool:
    """Whether a conditional write (``If-Match`` / ``If-None-Match``) lost."""
    code, status = error_code(exc)
    return code in _PRECONDITION_CODES or status in (409, 412)


def is_missing(exc: BaseException) -> bool:
    """Whether the key is absent (a missing bucket or upload is a different failure)."""
    code, status = error_code(exc)
    if code in ("NoSuchBucket", "NoSuchUpload"):
        return False
    return code in _MISSING_CODES or status == 404


def backoff(attempt: int, base: float = 0.05, cap: float = 5.0) -> float:
    """Full-jitter exponential backoff, as botocore's standard mode uses."""
    return random.uniform(0, min(cap, base * 2**attempt))
