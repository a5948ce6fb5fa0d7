"""The one reader: every restore path decodes committed versions through :class:`VersionReader`.

The manager's ``restore()``, the CLI (``restore``, ``verify``), the Hugging Face resume and any
tool built on the library read with the same code, so they verify the same things: the
manifest validates and names only keys of its run; every blob has its recorded xxh64 and every
chunk its own hash; delta bases and referenced tensors are followed only to versions that still
hold the exact blob the manifest recorded; the RNG/state file has its recorded xxh64 and was
saved at the manifest's step (a manifest carries no checksum of its own, so an altered step is
caught there). Reading never writes: no claims, no alias repairs.

Lightning and DeepSpeed checkpoints are single files, not run versions: :func:`read_tree_file`
decodes those (the same container verification, no manifest).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple, TypeVar

import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.errors import (
    ChecksumMismatch,
    DistributedError,
    InvalidFormat,
    KeyNotFound,
    MissingPrevious,
    VersionNotFound,
)
from mithril_async.manifest import BlobRef, VersionManifest, version_number
from mithril_async.pipeline.bases import BaseLoader
from mithril_async.pipeline.blobs import BlobCodec
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.pipeline.lossy import merge_lossy, read_lossy_blob, read_lossy_chain
from mithril_async.state import unflatten_state

__all__ = ["RESTORE_ERRORS", "DecodedVersion", "VersionReader", "read_tree_file", "read_version"]

log = logging.getLogger("mithril_async")
R = TypeVar("R")

#: what a damaged version raises; ``fallback=True`` moves on to an older version on these
RESTORE_ERRORS = (ChecksumMismatch, InvalidFormat, KeyNotFound, MissingPrevious)


class DecodedVersion(NamedTuple):
    """One version as a rank saved it: decoded state trees and its RNG/state document."""

    manifest: VersionManifest
    trees: dict[str, Any]
    #: the rank's RNG file (``rng``, ``states`` of get_state() objects, ``step``); empty when
    #: it was not asked for
    rng: dict[str, Any]


class VersionReader:
    """Decode versions of one run, every checksum and delta base verified on the way.

    ``codec``/``pool``: the manager passes its own (its codec threads do the decoding); tools
    leave them out and the reader makes (and on ``close()`` releases) a pool of its own.
    """

    def __init__(self, catalog: RunCatalog, *, codec: BlobCodec | None = None,
                 pool: concurrent.futures.Executor | None = None) -> None:
        self.catalog = catalog
        self._own_pool: concurrent.futures.ThreadPoolExecutor | None = None
        if pool is None:
            from mithril_async.codec.state_dict import default_threads

            pool = self._own_pool = concurrent.futures.ThreadPoolExecutor(
                default_threads(), "mithril-reader")
        self.pool = pool
        if codec is None:
            from mithril_async.config import CompressionConfig, PipelineConfig

            codec = BlobCodec(CompressionConfig(), PipelineConfig(), pool)
        self.codec = codec
        #: for read(): bases decoded for one version are reused by the next
        self._loader = BaseLoader(catalog, codec, "?")

    def close(self) -> None:
        if self._own_pool is not None:
            self._own_pool.shutdown(wait=True)

    def __enter__(self) -> VersionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def read(self, ref: BlobRef) -> tuple[Any, dict[str, Any]]:
        """(skeleton, tensors) of one blob, every checksum on the way verified.

        A lossy blob (``mldc``) is checked and parsed only: its tensors exist only decoded
        along its chain (:meth:`read_version`), so it gives no skeleton and no tensors."""
        if ref.format == "mldc":
            await read_lossy_blob(self.catalog.store, ref, ref.bytes, self.pool)
            return None, {}
        self._loader.needed_by = ref.key  # named by errors about its bases
        return await self.codec.read(self.catalog.store, ref, self._loader)

    async def check_blob(self, ref: BlobRef) -> None:
        """Verify one blob whole (every block, delta base and referenced tensor, and that it
        decodes to the raw size its manifest records) holding one tensor at a time: each is
        decoded with a loader of its own and dropped before the next, so memory stays at
        the blob plus one tensor whatever the blob claims (``mithril verify``)."""
        if ref.format == "mldc":  # lossy: checked and parsed, decoded only along its chain
            await self.read(ref)
            return
        async for _name, _tensor in self.codec.read_each(
                self.catalog.store, ref, lambda: BaseLoader(self.catalog, self.codec, ref.key)):
            pass

    async def read_version(self, target: str | int, *, rank: int = 0,
                           world_size: int | None = None, items: Collection[str] | None = None,
                           rng: bool = True, fallback: bool = False) -> DecodedVersion:
        """Decode ``target`` ("latest", "best", "v000003", a step, a manifest key) for ``rank``.

        ``items``: the state items to decode (None: all). ``rng``: also read and verify the
        rank's RNG/state file. ``world_size``: the reading job's, when it will resume from the
        version: a version saved by another number of ranks is refused with a
        :class:`DistributedError` that says what is possible. ``fallback``: if the target does
        not verify, the newest older version that does is returned (a warning names what was
        skipped); :class:`VersionNotFound` if none does.
        """
        key = await self.catalog.resolve(target)
        try:
            return await self._decode(key, rank, world_size, items, rng)
        except RESTORE_ERRORS as err:
            if not fallback:
                raise
            first_err = err
        bad_vid = key.rsplit("/", 2)[-2]
        try:
            bad_step: int | None = (await self.catalog.read_manifest(key)).step
        except RESTORE_ERRORS:  # the manifest itself is damaged: older version numbers
            bad_step = None
        for m in reversed(await self.catalog.versions(skip_damaged=True)):
            if (m.step >= bad_step if bad_step is not None
                    else version_number(m.version_id) >= version_number(bad_vid)):
                continue
            cand = self.catalog.layout.manifest_key(version_number(m.version_id))
            try:
                out = await self._decode(cand, rank, world_size, items, rng)
            except RESTORE_ERRORS as err:
                log.warning("fallback: %s does not verify either: %s", m.version_id, err)
                continue
            log.warning("restore fell back from %s (%s) to %s (step %d)", bad_vid,
                        first_err, m.version_id, m.step)
            return out
        raise VersionNotFound(f"no version at or before {bad_vid} verifies; "
                              f"first error: {first_err}") from first_err

    async def _decode(self, key: str, rank: int, world_size: int | None,
                      items: Collection[str] | None, rng: bool) -> DecodedVersion:
        m = await self.catalog.read_manifest(key)
        model_only = items is not None and set(items) == {"model"}
        if world_size is not None:
            _check_world_size(m, model_only, rank, world_size)
        refs: dict[str, BlobRef] = {"model": m.model}
        if m.optimizer is not None and not model_only:
            refs["optimizer"] = _rank_ref(m, "optimizer", m.optimizer.shards, rank)
        for name, shards in m.extra.items():
            if not model_only or name == "model":
                refs[name] = _rank_ref(m, name, shards, rank)
        if items is not None:
            refs = {name: ref for name, ref in refs.items() if name in items}
        # a model-only load across world sizes reads rank 0's lossy blob, as its model blob
        lossy_rank = rank if world_size is None or m.world_size == world_size else 0
        lossy = await self._read_lossy(m, lossy_rank)
        load_blob = BaseLoader(self.catalog, self.codec, m.version_id)
        # items decode concurrently: one's reads and Python work overlap another's decoding
        decoded = await all_or_first_error([self.codec.read(self.catalog.store, ref, load_blob)
                                            for ref in refs.values()])
        trees = {name: unflatten_state(skeleton, merge_lossy(name, tensors, lossy))
                 for name, (skeleton, tensors) in zip(refs, decoded, strict=True)}
        rng_doc = await self.read_rng(m, rank) if rng else {}
        return DecodedVersion(m, trees, rng_doc)

    async def read_rng(self, m: VersionManifest, rank: int) -> dict[str, Any]:
        """The rank's RNG/state document of ``m``, checked against the manifest."""
        rng_ref = _rank_ref(m, "rng", m.rng.keys, rank)
        rng_key = rng_ref.key
        rng_bytes = await self.catalog.get_metadata(rng_key)
        if rng_ref.xxh64 is not None:  # RNG and data-loader state: never loaded if damaged
            got = xxhash.xxh64_hexdigest(rng_bytes)
            if got != rng_ref.xxh64:
                raise ChecksumMismatch(rng_key, rng_ref.xxh64, got)
        try:
            rng_doc = json.loads(rng_bytes)
        except ValueError as err:
            raise InvalidFormat(f"{rng_key}: not valid JSON ({err})") from None
        if not isinstance(rng_doc, dict) or rng_doc.get("step") != m.step:
            # the RNG file is checksummed by the manifest and records the step: a manifest
            # whose step was altered (it carries no checksum of its own) is caught here
            key = self.catalog.layout.manifest_key(version_number(m.version_id))
            raise InvalidFormat(f"{key}: says step {m.step} but {rng_key} was saved at step "
                                f"{rng_doc.get('step') if isinstance(rng_doc, dict) else '?'}")
        return rng_doc

    async def _read_lossy(self, m: VersionManifest, rank: int) -> dict[str, Any]:
        """The rank's lossy tensors of ``m``, decoded along its chain (empty if lossless)."""
        if m.lossy is None:
            return {}

        async def manifest_of(vid: str) -> VersionManifest:
            return await self.catalog.read_manifest(
                self.catalog.layout.manifest_key(version_number(vid)))

        return await read_lossy_chain(self.catalog.store, m, rank, self.pool, manifest_of)


async def read_version(catalog: RunCatalog, target: str | int, **kw: Any) -> DecodedVersion:
    """One-shot :meth:`VersionReader.read_version` with a reader of its own."""
    with VersionReader(catalog) as reader:
        return await reader.read_version(target, **kw)


def _check_world_size(m: VersionManifest, model_only: bool, rank: int, world_size: int) -> None:
    """Refuse a resume across world sizes unless it is the full model of rank 0."""
    if m.world_size == world_size:
        return
    sharded = "model" in m.extra
    if model_only and not sharded:
        return
    possible = (f"restore with {m.world_size} rank(s) for an exact resume (model, optimizer "
                "shards, RNG and data state)")
    if not sharded:
        possible += ("; or restore(..., load='model') to load the full model written by "
                     "rank 0 on every rank and start the optimizer afresh")
    else:
        possible += "; its model is sharded per rank, so no model-only load either"
    raise DistributedError(
        f"{m.version_id} was saved by {m.world_size} rank(s) but this job has "
        f"{world_size} (rank {rank}); resharding is not supported. Possible: {possible}")


def _rank_ref(m: VersionManifest, what: str, refs: Sequence[R], rank: int) -> R:
    """The rank's entry of a per-rank list, or a clear error about the world size."""
    for ref in refs:
        if getattr(ref, "rank", None) == rank:
            return ref
    raise DistributedError(
        f"{m.version_id} was saved by {m.world_size} rank(s) and has no {what} shard for "
        f"rank {rank}; restore with the same world size, or load the model only "
        "(restore(..., load='model')) on rank 0")


def read_tree_file(data: bytes, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(container metadata, tensors) of a standalone checkpoint file (Lightning, DeepSpeed).

    The whole-file hash is verified while parsing, then every chunk's own hash while decoding.
    """
    from mithril_async.codec.state_dict import decompress_state_dict, read_info

    try:
        meta = read_info(data).metadata
    except InvalidFormat as err:
        raise InvalidFormat(f"{where}: {err}") from None
    tensors = decompress_state_dict(data, verify=False)  # parsing above verified the blob
    return meta, tensors
