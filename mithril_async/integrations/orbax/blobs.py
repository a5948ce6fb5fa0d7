"""The blobs of an item's folder: one written per process per save, read back by ranges.

Writing: the host copies of a process's pieces become one MCKP blob through the codec
(:func:`~mithril_async.codec.state_dict.compress_state_dict`: chunks coded on a thread pool,
every chunk hashed), with the index in its header, written crash-safely (temp file, fsync,
rename, folder fsync).

Reading: :class:`SavedItem` lists an item folder's blobs and reads only their trailers,
headers and indexes (three small reads each); :meth:`SavedItem.read` then reads and decodes
only the blocks of the pieces asked for, each block's header, payload and decoded bytes
checked against their hashes. Damage is a ``ChecksumMismatch`` / ``InvalidFormat`` that names
the parameter and the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from mithril_async.codec.container import MckpInfo
from mithril_async.codec.container_read import MckpRangeReader
from mithril_async.codec.state_dict import compress_state_dict, decode_tensors
from mithril_async.errors import ChecksumMismatch, ConfigError, InvalidFormat
from mithril_async.integrations.orbax.layout import (
    INDEX_KEY,
    LAYOUT,
    ParamRecord,
    Piece,
    blob_name,
    check_coverage,
    is_blob_name,
    merge_index,
)
from mithril_async.storage.atomic import atomic_write

__all__ = ["SavedItem", "local_folder", "write_blob"]


def local_folder(path: Any) -> str:
    """``path`` (an ``epath.Path`` or ``os.PathLike``) as a local file-system path.

    The blobs are written with POSIX calls (atomic rename, fsync), so the item folder must be
    on a local or mounted file system; a cloud URL (``gs://``, ``s3://``) is refused."""
    s = os.fspath(path)
    if "://" in s:
        raise ConfigError(f"the mithril_async Orbax handlers write to local or mounted file "
                          f"systems; {s} is not one")
    return s


def write_blob(folder: str, process: int, tensors: Mapping[str, np.ndarray[Any, Any]],
               params: list[dict[str, Any]], *, level: int, threads: int | None) -> str:
    """Encode ``tensors`` (name -> host array) into one blob whose header indexes ``params``
    (entries of :func:`~.layout.index_entry`); write it into ``folder``; return its name."""
    index = {"layout": LAYOUT, "process": process, "params": params}
    blob = compress_state_dict(tensors, level=level, threads=threads,
                               metadata={INDEX_KEY: index})
    name = blob_name(process)
    atomic_write(os.path.join(folder, name), blob)
    return name


class _Blob:
    """One open blob file: ranged reads with ``pread`` and its parsed header."""

    def __init__(self, folder: str, name: str) -> None:
        self.name = name
        self.path = os.path.join(folder, name)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(self.fd).st_size
            try:
                self.info: MckpInfo = MckpRangeReader(self.pread, size).open()
            except InvalidFormat as e:
                raise _named(e, self.path, None) from e
        except BaseException:
            os.close(self.fd)
            raise

    def pread(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        os.close(self.fd)


def _named(e: InvalidFormat, path: str, param: str | None) -> InvalidFormat:
    """``e`` again, naming the file (and the parameter when known)."""
    what = f"{path}" if param is None else f"parameter {param!r} in {path}"
    if isinstance(e, ChecksumMismatch):
        return ChecksumMismatch(f"{what}: {e.where}", e.expected, e.actual)
    return type(e)(f"{what}: {e}")


class SavedItem:
    """The blobs of one item folder: their merged index and ranged decoding.

    ``records``: every param any blob holds, by Orbax param name (pieces checked to cover
    each param exactly). Use as a context manager (it holds the blobs' descriptors)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        names = sorted(n for n in os.listdir(folder) if is_blob_name(n))
        self.blobs: dict[str, _Blob] = {}
        self.records: dict[str, ParamRecord] = {}
        try:
            for n in names:
                blob = self.blobs[n] = _Blob(folder, n)
                merge_index(self.records, blob.path, blob.info)
            for rec in self.records.values():
                check_coverage(rec)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, folder: str) -> SavedItem | None:
        """The blobs of ``folder``, or None when it holds none (not written by us)."""
        try:
            if not any(is_blob_name(n) for n in os.listdir(folder)):
                return None
        except FileNotFoundError:
            return None
        return cls(folder)

    def __enter__(self) -> SavedItem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self.blobs:
            self.blobs.popitem()[1].close()

    def read(self, pieces: Iterable[tuple[str, Piece]], *, threads: int | None,
             ) -> dict[Piece, np.ndarray[Any, Any]]:
        """Decode ``pieces`` (``(param name, piece)`` pairs) into arrays of their boxes.

        Only the blocks of those pieces are read; each blob's pieces are decoded by one
        call on up to ``threads`` threads."""
        by_file: dict[str, dict[str, tuple[str, Piece]]] = {}
        for param, p in pieces:
            by_file.setdefault(p.file, {})[p.tensor] = (param, p)
        out: dict[Piece, np.ndarray[Any, Any]] = {}
        for path, wanted in by_file.items():
            blob = self.blobs[os.path.basename(path)]
            try:
                arrays = decode_tensors(
                    blob.info, lambda r, b=blob: b.pread(r.offset, r.length),  # type: ignore[misc]
                    threads=threads, as_numpy=True, only=set(wanted), verify_payload=True)
            except InvalidFormat as e:
                raise _named(e, blob.path, _param_of(e, wanted)) from e
            for tensor, (_, piece) in wanted.items():
                out[piece] = arrays[tensor]
        return out


def _param_of(e: InvalidFormat, wanted: Mapping[str, tuple[str, Piece]]) -> str | None:
    """The param whose tensor an error names (errors name blocks as ``(tensor 'NAME', ...``)."""
    text = e.where if isinstance(e, ChecksumMismatch) else str(e)
    for tensor, (param, _) in wanted.items():
        if f"tensor {tensor!r}" in text:
            return param
    return None
