"""Manifests a recovery reads from any tier pass the one reader's checks first.

A recovery reads a version's manifest from the node folder, a peer or the remote bucket and
then fetches and writes every file it names. A manifest planted in the bucket (or a damaged
copy anywhere) must not make it fetch another run's file, or write one into the node folder:
so before anything is fetched, the manifest goes through the very checks the restore reader
applies (:func:`~mithril_async.catalog.check_manifest`: the key is the run's manifest key for
that version, the run id and version id match, every blob, RNG and config key lies inside the
run, every key is a safe store key), and its size is bounded before it is read
(:meth:`~mithril_async.catalog.RunCatalog.get_metadata`).
"""

from __future__ import annotations

from mithril_async.catalog import RunCatalog, check_manifest
from mithril_async.errors import InvalidFormat, KeyNotFound
from mithril_async.layout import RunLayout
from mithril_async.manifest import MAX_METADATA_BYTES, VersionManifest, parse_model
from mithril_async.storage.base import Store


def confined_manifest(layout: RunLayout, key: str, data: bytes | memoryview
                      ) -> VersionManifest:
    """``data`` (the bytes of ``key``, from wherever they came) as a manifest the reader
    accepts; :class:`~mithril_async.errors.InvalidFormat` (or ``UnsafeKey``) naming what
    leaves the run otherwise."""
    if len(data) > MAX_METADATA_BYTES:
        raise InvalidFormat(f"{key}: metadata file of {len(data)} bytes is implausibly large "
                            f"(limit {MAX_METADATA_BYTES})")
    m = parse_model(VersionManifest, bytes(data), key)
    check_manifest(layout, key, m)
    return m


async def read_confined(store: Store, layout: RunLayout, key: str
                        ) -> tuple[VersionManifest, bytes] | None:
    """``key``'s manifest in ``store`` and its bytes, checked as :func:`confined_manifest`
    (its size bounded before the read); None when ``store`` lacks it."""
    try:
        data = await RunCatalog(store, layout).get_metadata(key)
    except (KeyNotFound, FileNotFoundError):
        return None
    return confined_manifest(layout, key, data), data
