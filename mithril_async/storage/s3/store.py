"""``S3Store``: the Store protocol on S3 or an S3-compatible server (see the package doc).

The store adds listings, plain writes and deletes, streaming writers and the cleanup of
unfinished multipart uploads to the layers it is built from: :mod:`.connection` (requests),
:mod:`.reads` (parallel pinned reads) and :mod:`.conditional` (compare-and-swap writes).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Collection
from datetime import UTC, datetime

from mithril_async.errors import StorageError, UnsafeKey
from mithril_async.storage.base import (
    DirListing,
    Incomplete,
    Leftovers,
    check_key,
    check_prefix,
    dir_listing,
    key_in_prefix,
    skipped,
)
from mithril_async.storage.s3.conditional import S3ConditionalWrites
from mithril_async.storage.s3.connection import DEFAULT_PART_SIZE, MIN_PART_SIZE, ConditionalMode
from mithril_async.storage.s3.errors import error_code
from mithril_async.storage.s3.reads import MAX_RANGE, range_size
from mithril_async.storage.s3.writer import S3Writer

log = logging.getLogger("mithril_async.storage.s3")


class S3Store(S3ConditionalWrites):
    """S3-backed store; see the package docstring for guarantees and knobs."""

    #: every read is a request over the network: a restore reads each blob once (decoded into
    #: fresh tensors) rather than the local stores' verify-then-decode-in-place two passes
    remote_reads = True

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
    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.put_object("put", key, data)

    async def delete(self, key: str) -> None:
        await self.call("delete", key, "delete_object", Key=self.full_key(key))

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


__all__ = [
    "DEFAULT_PART_SIZE",
    "MAX_RANGE",
    "MIN_PART_SIZE",
    "ConditionalMode",
    "S3Store",
    "range_size",
]
