"""The synchronous ``Compressor``: save/load compressed state dicts by key.

A small, dependency-free face over the codec for scripts that do not want the async manager::

    c = Compressor(storage="local:///tmp/ckpts", delta_enabled=True)
    meta = c.save(model.state_dict(), key="step_1000", previous_key="step_900")
    print(meta.original_size, meta.compressed_size, meta.ratio)
    model.load_state_dict(c.load("step_1000"))

Each key is one MCKP blob ``<root>/<key>.mckp`` written atomically (temp file, fsync, rename,
directory fsync), so a crash leaves either the old file or the new one.  With
``delta_enabled`` a save against ``previous_key`` stores XOR deltas against that checkpoint
(reconstructed in full first, so chains work); ``load`` follows the chain by itself, and
raises :class:`~mithril_async.errors.MissingPrevious` if a base is gone or was replaced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.container import FLAG_DELTA
from mithril_async.codec.container_read import parse_blob
from mithril_async.codec.state_dict import compress_state_dict, decompress_state_dict
from mithril_async.errors import (
    ConfigError,
    KeyExists,
    KeyNotFound,
    MissingPrevious,
    UnsafeKey,
)
from mithril_async.storage.atomic import atomic_write

__all__ = ["CheckpointMeta", "Compressor"]

_KEY = re.compile(r"[A-Za-z0-9_.=-]+(/[A-Za-z0-9_.=-]+)*")
_PREV_KEY = "mithril.previous_key"
_MAX_CHAIN = 10_000


@dataclass(frozen=True)
class CheckpointMeta:
    """What :meth:`Compressor.save` reports."""

    key: str
    previous_key: str | None
    original_size: int
    compressed_size: int
    xxh64: str

    @property
    def ratio(self) -> float:
        return self.original_size / self.compressed_size if self.compressed_size else 0.0


def _root_of(storage: str | os.PathLike[str]) -> Path:
    s = os.fspath(storage)
    if "://" in s:
        scheme, rest = s.split("://", 1)
        if scheme != "local":
            raise ConfigError(f"storage: scheme {scheme!r} is not supported (use local://)")
        s = rest
    if not s:
        raise ConfigError("storage: empty path")
    return Path(s)


class Compressor:
    """Synchronous compressed checkpoint store on a local directory (see module docs)."""

    def __init__(self, storage: str | os.PathLike[str] = "local://./checkpoints", *,
                 delta_enabled: bool = True, byte_grouping: bool = True,
                 compression_level: int = 3, threads: int | None = None,
                 chunk_bytes: int = CodecParams.chunk_bytes) -> None:
        self.root = _root_of(storage)
        self.delta_enabled = delta_enabled
        self.params = CodecParams(level=compression_level, byte_grouping=byte_grouping,
                                  chunk_bytes=chunk_bytes)
        self.threads = threads

    # ---------------------------------------------------------------- paths

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key) or any(
                part in (".", "..") for part in key.split("/")):
            raise UnsafeKey(f"key {key!r}: use letters, digits, '_.=-' and '/' separators")
        return self.root / f"{key}.mckp"

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def keys(self) -> list[str]:
        """Every stored key, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(str(p.relative_to(self.root))[: -len(".mckp")]
                      for p in self.root.rglob("*.mckp") if p.is_file())

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            raise KeyNotFound(f"checkpoint {key!r} not found in {self.root}") from None

    def _read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyNotFound(f"checkpoint {key!r} not found in {self.root}") from None

    def _write_atomic(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)

    # ---------------------------------------------------------------- API

    def save(self, state_dict: Mapping[str, Any], key: str, previous_key: str | None = None,
             *, step: int | None = None, metadata: dict[str, Any] | None = None,
             overwrite: bool = False) -> CheckpointMeta:
        """Compress ``state_dict`` under ``key`` (delta against ``previous_key`` if enabled).

        Refuses to replace an existing key unless ``overwrite`` (a replaced key breaks the
        checkpoints that use it as a base; their loads then raise ``MissingPrevious``).
        """
        path = self._path(key)
        if path.exists() and not overwrite:
            raise KeyExists(f"checkpoint {key!r} already exists in {self.root}")
        previous: dict[str, torch.Tensor] | None = None
        prev_hash: str | None = None
        meta = dict(metadata or {})
        if previous_key is not None and self.delta_enabled:
            if previous_key == key:
                raise ConfigError("previous_key: a checkpoint cannot be its own base")
            prev_blob = self._read(previous_key)
            prev_hash = f"{xxhash.xxh64_intdigest(prev_blob):016x}"
            previous = self._load_blob(previous_key, prev_blob)
            meta[_PREV_KEY] = previous_key
        blob = compress_state_dict(state_dict, previous=previous, params=self.params,
                                   threads=self.threads, step=step, metadata=meta,
                                   previous_checkpoint_hash=prev_hash)
        self._write_atomic(path, blob)
        info = parse_blob(blob, verify=False)
        return CheckpointMeta(key, previous_key if previous is not None else None,
                              info.original_size, len(blob),
                              f"{xxhash.xxh64_intdigest(blob):016x}")

    def load(self, key: str) -> dict[str, Any]:
        """Decompress ``key``, resolving its chain of delta bases."""
        return self._load_blob(key, self._read(key))

    def _load_blob(self, key: str, blob: bytes) -> dict[str, Any]:
        # Walk back to the first full checkpoint, then decode forward (no recursion).
        chain: list[tuple[str, bytes]] = [(key, blob)]
        seen = {key}
        while True:
            cur_key, cur = chain[-1]
            info = parse_blob(cur)
            if not info.flags & FLAG_DELTA:
                break
            base_key = info.metadata.get(_PREV_KEY)
            if not isinstance(base_key, str):
                raise MissingPrevious(f"checkpoint {cur_key!r} is a delta but does not name "
                                      "its base key")
            if base_key in seen or len(chain) > _MAX_CHAIN:
                raise MissingPrevious(f"checkpoint {cur_key!r}: delta chain loops at "
                                      f"{base_key!r}")
            try:
                base_blob = self._read(base_key)
            except KeyNotFound:
                raise MissingPrevious(f"checkpoint {cur_key!r} needs base {base_key!r}, "
                                      "which is gone") from None
            got = f"{xxhash.xxh64_intdigest(base_blob):016x}"
            if info.previous_checkpoint_hash not in (None, got):
                raise MissingPrevious(f"checkpoint {cur_key!r} needs base {base_key!r}, which "
                                      "was replaced since (blob hash differs)")
            seen.add(base_key)
            chain.append((base_key, base_blob))
        state: dict[str, Any] | None = None
        for _, b in reversed(chain):
            state = decompress_state_dict(b, previous=state, threads=self.threads)
        assert state is not None
        return state
