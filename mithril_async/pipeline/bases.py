"""Resolve the blobs a version's deltas and tensor references point at, for one restore.

One loader serves a whole restore (the manager's and the read-only ``VersionReader``'s alike):
every link is checked (the holder version's manifest must list the blob with the xxh64 the
reference names) and a blob is asked only for the tensors that are needed from it, so a delta
version whose AdamW moments were stored in full decodes the weights of its base and nothing
else. Decoded tensors are cached per blob: a second request for other tensors of the same blob
decodes only those.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from mithril_async.errors import InvalidFormat, KeyNotFound, MissingPrevious
from mithril_async.manifest import BaseRef, BlobRef, version_number

if TYPE_CHECKING:
    from mithril_async.catalog import RunCatalog
    from mithril_async.pipeline.blobs import BlobCodec

__all__ = ["BaseLoader"]

#: the blobs the current task is decoding, outermost first (each restore item is a task)
_CHAIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("mithril_chain",
                                                                          default=())


class BaseLoader:
    """``await loader(base, names)``: tensors ``names`` of the blob ``base`` names (a
    :data:`~mithril_async.pipeline.blobs.LoadBlob`); errors name ``needed_by``."""

    def __init__(self, catalog: RunCatalog, codec: BlobCodec, needed_by: str) -> None:
        self.catalog = catalog
        self.codec = codec
        self.needed_by = needed_by
        self._tensors: dict[str, dict[str, Any]] = {}
        self._refs: dict[str, BlobRef] = {}

    async def __call__(self, base: BaseRef, names: frozenset[str]) -> dict[str, Any]:
        path = _CHAIN.get()
        if base.key in path:  # hostile or damaged manifests: a chain must not loop
            raise InvalidFormat(f"{self.needed_by}: the chain of bases loops through "
                                f"{base.key} ({' -> '.join(path)})")
        have = self._tensors.setdefault(base.key, {})
        missing = names - have.keys()
        if not missing:
            return have
        # no lock per blob: a task holding one while waiting for another's could deadlock on
        # a damaged chain; two items asking the same blob at once (their chains are separate
        # blobs, so only a damaged run does) just decode it twice
        ref = await self._ref_of(base)
        token = _CHAIN.set((*path, base.key))
        try:
            _, tensors = await self.codec.read(self.catalog.store, ref, self, only=missing)
        except KeyNotFound:
            raise MissingPrevious(f"{self.needed_by} needs {base.key} from version "
                                  f"{base.version_id}, whose blob is gone") from None
        finally:
            _CHAIN.reset(token)
        have.update(tensors)
        return have

    async def _ref_of(self, base: BaseRef) -> BlobRef:
        """The holder version's own record of the blob, checked against the reference."""
        ref = self._refs.get(base.key)
        if ref is not None and ref.xxh64 == base.xxh64:
            return ref
        try:
            holder = await self.catalog.read_manifest(
                self.catalog.layout.manifest_key(version_number(base.version_id)))
        except KeyNotFound:
            raise MissingPrevious(f"{self.needed_by} needs {base.key} from version "
                                  f"{base.version_id}, which is gone") from None
        found = next((b for b in holder.blobs() if b.key == base.key), None)
        if found is None or found.xxh64 != base.xxh64:
            raise MissingPrevious(f"{self.needed_by} needs {base.key} (xxh64 {base.xxh64}) "
                                  f"but version {base.version_id} holds "
                                  f"{'no such blob' if found is None else found.xxh64}")
        self._refs[base.key] = found
        return found
