"""Optional store capabilities, declared as protocols and checked with ``isinstance``.

The :class:`~mithril_async.storage.base.Store` protocol is what every store implements. Some
stores can do more, and the pipeline uses that where it helps: a local folder root the run
records, blocking ranged reads on a worker thread, private files, reads across a network
(which change how a restore reads), a bounded request concurrency. Each is a small
runtime-checkable protocol here, so a store declares what it offers by having the attribute
or method, and callers ask with ``isinstance`` instead of guessing with ``getattr``; a
store written against the plain protocol (a user's, a test's) keeps working without them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["BoundedConcurrency", "HasLocalRoot", "PrivateWrites", "RangeReader",
           "RangeReading", "RemoteReads", "local_root", "read_concurrency"]


class RangeReader(Protocol):
    """Ranged reads of one stored value on the calling thread (blocking), for a worker
    thread that decodes what it reads (a store with
    :class:`~mithril_async.storage.capabilities.RangeReading` opens one)."""

    def read(self, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer only at the end of the value)."""

    def close(self) -> None:
        """Release the value's handle; idempotent. No read may be running."""


@runtime_checkable
class HasLocalRoot(Protocol):
    """A store over a local folder (or with one as its primary side): the folder's path,
    recorded in the run's ``run.json``; None where a wrapper has no local side."""

    @property
    def root(self) -> object: ...


@runtime_checkable
class RangeReading(Protocol):
    """A store that opens one value for many blocking ranged reads on the caller's thread
    (a restore reads and decodes a window in one pool task). ``open_range_reader`` may
    return None when this instance cannot (then the caller reads with ``get_range``)."""

    async def open_range_reader(self, key: str) -> RangeReader | None: ...


@runtime_checkable
class PrivateWrites(Protocol):
    """A store that can write a value only its owner may read (``put_private``)."""

    async def put_private(self, key: str, data: bytes | memoryview) -> None: ...


@runtime_checkable
class RemoteReads(Protocol):
    """A store whose reads cross a network (S3): a second read of every byte costs more
    than the memory a one-pass decode into fresh tensors takes, and larger concurrent
    ranged reads pay. ``remote_reads`` is True for such a store."""

    remote_reads: bool


@runtime_checkable
class SizedListing(Protocol):
    """A store that lists keys with their sizes in one pass (an S3 listing carries them, a
    directory scan has them): checking that the thousands of files of a version are all
    present with their sizes then costs a few listings, not a request per file."""

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` (as :meth:`Store.list`) with its size in bytes."""
        ...


async def sizes_under(store: object, prefix: str) -> dict[str, int] | None:
    """``store.list_sizes(prefix)`` where the store can (:class:`SizedListing`), else None:
    the caller asks each key's size instead."""
    if not isinstance(store, SizedListing):
        return None
    return await store.list_sizes(prefix)


@runtime_checkable
class BoundedConcurrency(Protocol):
    """A store that serves at most ``max_concurrency`` requests at once."""

    max_concurrency: int


def local_root(store: object) -> str | None:
    """The local folder a store writes into, as text; None for a store without one."""
    if not isinstance(store, HasLocalRoot):
        return None
    root = store.root
    return None if root is None else str(root)


def read_concurrency(store: object) -> int:
    """How many ranged reads a restore keeps in flight against ``store``: its request
    concurrency when its reads cross a network, 0 for a local store (the codec threads
    decide there)."""
    if not (isinstance(store, RemoteReads) and store.remote_reads):
        return 0
    if isinstance(store, BoundedConcurrency):
        return max(1, int(store.max_concurrency or 8))
    return 8
