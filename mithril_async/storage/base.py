"""The Store protocol: a small async key/value interface every backend implements.

Keys are repo-root relative POSIX paths (``runs/<run_id>/versions/v000001/model.mckp``).
Every backend validates keys with :func:`check_key` so that nothing read from a manifest can
escape the store root. Writes are atomic and durable when they return: readers see the old
value or the new one, never a torn one. Large blobs stream through :class:`BlobWriter`
(multipart on S3, temp file + fsync + rename on disk); an aborted writer leaves nothing behind.

Key components starting with ``.tmp-`` are reserved: backends use them for temp files and
lock files, so :func:`check_key` refuses them and :meth:`Store.list` never returns them.

``list(prefix)`` has directory semantics on every backend: ``""`` lists everything,
``"a/b/"`` or ``"a/b"`` list ``a/b`` itself (if it is a key) and every key below ``a/b/`` -
but never ``a/bc``. This keeps S3 (plain string prefixes) and the file system alike.

``list_dir(prefix)`` lists one level of the same tree (a :class:`DirListing`): the names of the
keys directly in the folder ``prefix`` and of its sub-folders, where a folder exists exactly
when some key lies below it (an empty directory or one holding only temp files does not count).
A caller that needs one level (e.g. which version folders a run has) reads it without every
key below; on S3 that is one delimited listing (``Delimiter="/"``) per folder.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Iterable
from types import TracebackType
from typing import NamedTuple, Protocol, runtime_checkable

from mithril_async.errors import UnsafeKey
from mithril_async.storage.capabilities import PrivateWrites

_KEY_PART = re.compile(r"^[A-Za-z0-9._=+@,-]+$")

#: key components starting with this are reserved for backend temp/lock files
RESERVED_PREFIX = ".tmp-"


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`UnsafeKey` naming it."""
    if not isinstance(key, str) or not key:
        raise UnsafeKey(f"store key must be a non-empty string, got {key!r}")
    if len(key) > 1024:
        raise UnsafeKey(f"store key longer than 1024 characters: {key[:64]!r}...")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise UnsafeKey(f"store key must be relative without backslashes or NUL: {key!r}")
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafeKey(f"store key has an empty, '.' or '..' component: {key!r}")
        if not _KEY_PART.match(part):
            raise UnsafeKey(f"store key has characters outside [A-Za-z0-9._=+@,-]: {key!r}")
        if part.startswith(RESERVED_PREFIX):
            raise UnsafeKey(f"store key component uses reserved {RESERVED_PREFIX!r}: {key!r}")
    if posixpath.normpath(key) != key:
        raise UnsafeKey(f"store key is not normalised: {key!r}")
    return key


def check_prefix(prefix: str) -> str:
    """Validate a list/cleanup prefix; return it without a trailing '/' (``""`` = everything)."""
    if not isinstance(prefix, str):
        raise UnsafeKey(f"store prefix must be a string, got {prefix!r}")
    stripped = prefix[:-1] if prefix.endswith("/") else prefix
    if stripped == "":
        if prefix not in ("", "/"):
            raise UnsafeKey(f"store prefix is not normalised: {prefix!r}")
        return ""
    return check_key(stripped)


def key_in_prefix(key: str, prefix: str) -> bool:
    """Whether ``key`` lies under a prefix already normalised by :func:`check_prefix`."""
    return prefix == "" or key == prefix or key.startswith(prefix + "/")


def join_key(*parts: str) -> str:
    """Join key components with '/', validating the result."""
    return check_key("/".join(p.strip("/") for p in parts if p))


class Incomplete(NamedTuple):
    """A leftover of an unfinished write (a temp file, a multipart upload)."""

    #: the key being written (S3, memory) or the temp file's path below the root (local)
    key: str
    #: seconds since it was started (an upload) or last written (a temp file)
    age_s: float


#: what ``list_incomplete`` returns (a name, since ``list`` is a Store method)
Leftovers = list[Incomplete]


def skipped(key: str, skip: Collection[str]) -> bool:
    """Whether ``key`` lies under one of the ``skip`` prefixes of ``cleanup_incomplete``."""
    return any(key_in_prefix(key, check_prefix(p)) for p in skip)


class DirListing(NamedTuple):
    """One level of a store folder: names (single key components, no ``/``), each sorted."""

    #: names of the keys directly in the folder (``folder/<name>`` is a key)
    files: list[str]
    #: names of the sub-folders (some key lies below ``folder/<name>/``)
    dirs: list[str]


def child_name(rel: str) -> tuple[str, bool] | None:
    """Split a key relative to a listed folder into (first component, is a sub-folder);
    ``None`` when that component is no valid key part (temp files, foreign names)."""
    name, sep, _ = rel.partition("/")
    try:
        check_key(name)
    except UnsafeKey:
        return None
    return name, bool(sep)


def dir_listing(rels: Iterable[str]) -> DirListing:
    """The :class:`DirListing` of a folder from keys relative to it (below it at any depth)."""
    files: set[str] = set()
    dirs: set[str] = set()
    for rel in rels:
        child = child_name(rel)
        if child is not None:
            (dirs if child[1] else files).add(child[0])
    return DirListing(sorted(files), sorted(dirs))


def as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """Return ``data`` as immutable bytes (copying only when it is not bytes already)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview):
        return data.cast("B").tobytes() if data.contiguous else data.tobytes()
    return bytes(data)


def check_range(key: str, start: int, length: int) -> None:
    """Refuse negative ranges up front so every backend reports them the same way."""
    if start < 0 or length < 0:
        raise ValueError(f"invalid range start={start} length={length} for key {key!r}")


@runtime_checkable
class BlobWriter(Protocol):
    """A streaming writer for one key. Nothing is visible until :meth:`commit` returns.

    Concrete writers are also async context managers: ``async with store.open_writer(k) as w``
    commits on normal exit and aborts on an exception.
    """

    key: str

    async def write(self, data: bytes | memoryview) -> None:
        """Append ``data``; may upload a part in the background (bounded)."""

    async def commit(self) -> int:
        """Make the blob durable and visible under ``key``; return its size in bytes."""

    async def abort(self) -> None:
        """Discard everything written; idempotent, never raises for a missing upload."""


class WriterContext:
    """Mixin giving a writer ``async with`` semantics: commit on success, abort on error."""

    async def commit(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    async def abort(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def __aenter__(self) -> WriterContext:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()


@runtime_checkable
class Store(Protocol):
    """Async storage backend. See the module docstring for the contract."""

    #: a short human-readable description, e.g. ``file:///data`` or ``s3://bucket/prefix``
    url: str
    #: whether put_if_absent / put_if_match are atomic on this backend
    atomic_conditional_writes: bool

    async def get(self, key: str) -> bytes:
        """Return the whole value; :class:`KeyNotFound` when absent."""

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """Return ``length`` bytes from ``start`` (fewer only at the end of the value)."""

    async def size(self, key: str) -> int:
        """Size in bytes of the value; :class:`KeyNotFound` when absent."""

    async def exists(self, key: str) -> bool:
        """Whether ``key`` is present."""

    async def put(self, key: str, data: bytes | memoryview) -> None:
        """Atomically create or replace ``key``; durable on return."""

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Create ``key`` only if absent, else raise :class:`KeyExists`."""

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Return the value and an opaque version tag for :meth:`put_if_match`."""

    async def put_if_match(self, key: str, data: bytes | memoryview, etag: str | None) -> str:
        """Replace ``key`` only if its tag is still ``etag`` (``None``: only if absent).

        Returns the new tag; raises :class:`PreconditionFailed` when another writer won.
        """

    async def list(self, prefix: str) -> list[str]:
        """All keys under ``prefix`` (directory semantics, see module doc), sorted."""

    async def list_dir(self, prefix: str) -> DirListing:
        """One level below the folder ``prefix`` (``""``: the root): the names of the keys
        directly in it and of its sub-folders (see module doc). A key, not a folder, at
        ``prefix`` itself is not listed; a missing folder lists empty."""

    async def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    def open_writer(self, key: str) -> BlobWriter:
        """Start a streaming write of ``key``."""

    async def list_incomplete(self, prefix: str) -> Leftovers:
        """The leftovers of unfinished writes under ``prefix`` (temp files, multipart
        uploads), with their ages: what :meth:`cleanup_incomplete` would consider."""

    async def cleanup_incomplete(self, prefix: str, older_than: float = 0.0, *,
                                 skip: Collection[str] = ()) -> int:
        """Remove leftovers of killed writers under ``prefix`` (temp files, multipart
        uploads) that are at least ``older_than`` seconds old; return how many were removed.

        ``older_than`` protects writers still running in other processes; ``0`` removes all.
        ``skip``: prefixes (folders or keys, :func:`check_prefix` rules) whose leftovers are
        never touched, whatever their age: the version folders of saves known to be live.
        """

    async def close(self) -> None:
        """Release connections and file handles."""


async def put_private(store: Store, key: str, data: bytes | memoryview) -> None:
    """:meth:`Store.put` of a value only the store's owner may read, where the store can
    say so (:class:`~mithril_async.storage.capabilities.PrivateWrites`: LocalStore writes a
    0600 file, MirrorStore on both sides), else a plain ``put`` (S3 objects are private
    unless a bucket policy shares them)."""
    await (store.put_private(key, data) if isinstance(store, PrivateWrites)
           else store.put(key, data))
