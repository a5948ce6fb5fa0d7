"""Conditional writes of an :class:`~mithril_async.storage.s3.S3Store` (``put_if_absent``,
``put_if_match``): ``IfNoneMatch="*"`` / ``IfMatch=<etag>`` on PutObject where the server honours
both (probed once under ``conditional_writes="auto"``), else a logged, non-atomic
read-compare-write. ``If-Match`` is sent quoted or unquoted, whichever the server compares; an
answer without an ETag is completed by reading the ETag back.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
from collections.abc import Callable
from typing import Any, Literal

from botocore.exceptions import ClientError

from mithril_async.errors import KeyExists, KeyNotFound, PreconditionFailed, StorageError
from mithril_async.storage.base import RESERVED_PREFIX, as_bytes
from mithril_async.storage.s3.errors import CALL_ERRORS, is_missing, is_precondition
from mithril_async.storage.s3.reads import S3Reads

log = logging.getLogger("mithril_async.storage.s3")


class S3ConditionalWrites(S3Reads):
    """The compare-and-swap writes, and the probe that decides how they are made."""

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
