"""Read committed versions without a manager: blobs, delta bases, tensor references, RNG.

Why not ``CheckpointManager.restore``: that needs live objects to load into and starts the
manager (which cleans up unfinished saves and creates the ``best`` alias). The CLI and the
resume helpers only *read*, and want the decoded trees themselves. This mirrors the manager's
restore path with the library's own pieces (``RunCatalog`` + ``BlobCodec.read``), so every
checksum and every delta base is verified the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mithril_async.catalog import RunCatalog
    from mithril_async.manifest import BlobRef, VersionManifest

__all__ = ["VersionReader", "open_catalog", "read_version"]


def open_catalog(runs_dir: str | Path, run_id: str) -> RunCatalog:
    """The catalog of ``<runs_dir>/<run_id>`` on local disk (keys relative to its parent)."""
    from mithril_async.catalog import RunCatalog
    from mithril_async.layout import RunLayout
    from mithril_async.storage.local import LocalStore

    runs = Path(runs_dir).expanduser().absolute()
    return RunCatalog(LocalStore(runs.parent), RunLayout(runs.name, run_id))


class VersionReader:
    """Decode the blobs of versions in one run, resolving delta bases and tensor references.

    Mirrors the manager's restore path (``BlobCodec.read`` with a loader for bases) without
    starting a manager, so reading never writes anything (no claims, no alias repairs).
    """

    def __init__(self, catalog: RunCatalog) -> None:
        import concurrent.futures

        from mithril_async.codec.state_dict import default_threads
        from mithril_async.config import CompressionConfig, PipelineConfig
        from mithril_async.pipeline.bases import BaseLoader
        from mithril_async.pipeline.blobs import BlobCodec

        self.catalog = catalog
        self.pool = concurrent.futures.ThreadPoolExecutor(default_threads(), "mithril-cli")
        self.codec = BlobCodec(CompressionConfig(), PipelineConfig(), self.pool)
        #: one for all reads: bases decoded for one version are reused by the next
        self._loader = BaseLoader(catalog, self.codec, "?")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    async def read(self, ref: BlobRef) -> tuple[Any, dict[str, Any]]:
        """(skeleton, tensors) of one blob, every checksum on the way verified."""
        self._loader.needed_by = ref.key  # named by errors about its bases
        return await self.codec.read(self.catalog.store, ref, self._loader)


async def _lossy_tensors(catalog: RunCatalog, m: VersionManifest, rank: int,
                         reader: VersionReader) -> dict[str, Any]:
    """The lossy tier's tensors of ``m`` (``[checkpointing.lossy]``), decoded along its chain."""
    if m.lossy is None:
        return {}
    from mithril_async.manifest import version_number
    from mithril_async.pipeline.lossy import read_lossy_chain

    async def manifest_of(vid: str) -> VersionManifest:
        return await catalog.read_manifest(catalog.layout.manifest_key(version_number(vid)))

    return await read_lossy_chain(catalog.store, m, rank, reader.pool, manifest_of)


async def read_version(catalog: RunCatalog, target: str | int, *, rank: int = 0,
                       items: set[str] | None = None
                       ) -> tuple[VersionManifest, dict[str, Any], dict[str, Any]]:
    """(manifest, {item: state tree}, rng document) of one version, as ``rank`` saved it."""
    from mithril_async.errors import InvalidFormat
    from mithril_async.pipeline.lossy import merge_lossy
    from mithril_async.state import unflatten_state

    m = await catalog.read_manifest(await catalog.resolve(target))
    refs: dict[str, BlobRef] = {"model": m.model}
    shards = dict(m.extra)
    if m.optimizer is not None:
        shards["optimizer"] = m.optimizer.shards
    for name, per_rank in shards.items():
        for s in per_rank:
            if s.rank == rank:
                refs[name] = s
    reader = VersionReader(catalog)
    trees: dict[str, Any] = {}
    try:
        lossy = await _lossy_tensors(catalog, m, rank, reader)
        for name, ref in refs.items():
            if items is None or name in items:
                skeleton, tensors = await reader.read(ref)
                trees[name] = unflatten_state(skeleton, merge_lossy(name, tensors, lossy))
    finally:
        reader.close()
    rng_doc: dict[str, Any] = {}
    for rk in m.rng.keys:
        if rk.rank == rank:
            try:
                rng_doc = json.loads(await catalog.store.get(rk.key))
            except ValueError as err:
                raise InvalidFormat(f"{rk.key}: not valid JSON ({err})") from None
    return m, trees, rng_doc
