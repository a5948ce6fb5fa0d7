"""A Store on S3 or an S3-compatible server (R2, MinIO, moto) via aioboto3.

Keys live under ``<prefix>/<key>`` in one bucket. Design points:

- **Streaming multipart writes**: :class:`~mithril_async.storage.s3.writer.S3Writer` (bounded
  concurrency and memory, part size growing every 900 parts). Every part and PUT carries a
  CRC32 checksum (computed on a worker thread), which S3 verifies on receipt (moto and Ceph
  RGW do not: the manifest's own chunk and blob hashes, checked on read, cover every server).
- **Parallel reads**: ``get`` / ``get_range`` split large reads into part-sized ranged GETs run
  concurrently (a HEAD beside the first range gives the size at once); the ranges are pinned
  to one ETag (``IfMatch``), so a concurrent overwrite restarts the read instead of mixing
  versions.
- **Conditional writes**: ``IfNoneMatch="*"`` / ``IfMatch=<etag>`` on PutObject (S3 since
  2024, moto >= 5.0.x). ``conditional_writes="auto"`` probes the server once: of an existing
  object, a PUT with ``If-None-Match: *`` and one with a wrong ``If-Match`` must both be
  refused; a server that ignores either header gets a logged, *non-atomic*
  read-compare-write fallback and ``atomic_conditional_writes`` becomes False. ``If-Match``
  is sent quoted or unquoted, whichever the server compares (Ceph RGW: unquoted); 404 and
  412 on a missing key both fail the precondition. A conditional PUT answered without an
  ETag succeeded all the same; its ETag is read back (only while the object holds what was
  written).
- **Retries**: botocore's "standard" mode retries 5xx, throttling (SlowDown), connection
  errors and timeouts with jittered exponential backoff, up to ``max_attempts`` attempts per
  request; streamed response bodies (not covered by botocore) are retried here the same way.
  Permanent failures become :class:`StorageError` naming ``s3://bucket/key``; 404s become
  :class:`KeyNotFound`. S3's "200 OK with an <Error> body" on CompleteMultipartUpload is turned
  into a retryable 500 by botocore. A completion with an empty ETag (Ceph RGW) is checked
  by a HEAD: the object must exist with an ETag, exactly the size sent and, where the server
  returns one, the CRC32 of the parts sent. Parts a server refuses as too small
  (``EntityTooSmall``) fail the commit with an error naming the part size to raise.
- **Listings**: ``list`` pages through every key under a prefix; ``list_dir`` is one
  delimited listing (``Delimiter="/"``): the keys of one folder and its sub-folders only.
- **No hangs**: ``Expect: 100-continue`` is dropped (aiohttp waits for the go-ahead without any
  timeout), and every request has a generous watchdog (:meth:`S3Store.watchdog`) because
  aiohttp has no timeout on sending a body to a server that stopped reading.
- Credentials come from the standard AWS chain (env vars, profiles, instance roles); nothing
  here reads or logs them.

Modules: :mod:`.store` (``S3Store``: listings, plain writes, uploads' cleanup), built on
:mod:`.connection` (client, key mapping, typed errors, watchdog, retries), :mod:`.reads`
(parallel reads pinned to one ETag) and :mod:`.conditional` (compare-and-swap writes);
:mod:`.writer` (``S3Writer``, which sends its requests through the small
:class:`~mithril_async.storage.s3.writer.S3Requests` interface the store implements), and
:mod:`.errors` (telling botocore's failures apart). Importing this package imports aioboto3 (the
``s3`` extra: without it the import fails naming ``mithril_async[s3]``);
:mod:`mithril_async.storage` defers that until an S3 store is opened.
"""

try:
    import aioboto3  # noqa: F401  (the optional dependency, checked once with a clear message)
except ImportError as _missing:
    raise ImportError(
        f"S3 storage needs aioboto3 ({_missing}); install it with "
        "`pip install 'mithril_async[s3]'`"
    ) from _missing

from mithril_async.storage.s3.errors import error_code, is_missing, is_precondition
from mithril_async.storage.s3.store import (
    DEFAULT_PART_SIZE,
    MAX_RANGE,
    MIN_PART_SIZE,
    S3Store,
    range_size,
)
from mithril_async.storage.s3.writer import (
    MAX_OBJECT_SIZE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MIB,
    S3Requests,
    S3Writer,
    composite_crc32,
    crc32_b64,
    max_blob_size,
    part_size_at,
    part_size_for,
)

__all__ = [
    "DEFAULT_PART_SIZE",
    "MAX_OBJECT_SIZE",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MAX_RANGE",
    "MIB",
    "MIN_PART_SIZE",
    "S3Requests",
    "S3Store",
    "S3Writer",
    "composite_crc32",
    "crc32_b64",
    "error_code",
    "is_missing",
    "is_precondition",
    "max_blob_size",
    "part_size_at",
    "part_size_for",
    "range_size",
]
