"""The one reader: every restore path decodes committed versions through :class:`VersionReader`.

The manager's ``restore()``, the CLI (``restore``, ``verify``), the Hugging Face resume and any
tool built on the library read with the same code, so they verify the same things: the
manifest validates and names only keys of its run; every blob has its recorded xxh64 and every
chunk its own hash; delta bases and referenced tensors are followed only to versions that still
hold the exact blob the manifest recorded; the RNG/state file has its recorded xxh64 and was
saved at the manifest's step (a manifest carries no checksum of its own, so an altered step is
caught there). Reading never writes: no claims, no alias repairs.

A restore is planned (:mod:`~mithril_async.restore.plan`) and carried out
(:mod:`~mithril_async.restore.execute`); this module resolves the target, and with
``fallback=True`` moves on to older versions when the target does not verify. How what is
written into the live tensors is verified (``verify``) is the config's
:attr:`~mithril_async.config.RestoreConfig.verify`.

Lightning and DeepSpeed checkpoints are single files, not run versions: :func:`read_tree_file`
decodes those (the same container verification, no manifest).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from typing import Any

import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.codec.formats import blob_format
from mithril_async.errors import (
    ChecksumMismatch,
    ConfigError,
    InvalidFormat,
    KeyNotFound,
    MissingPrevious,
    RestoreIncomplete,
    VersionNotFound,
)
from mithril_async.manifest import BlobRef, VersionManifest, version_number
from mithril_async.pipeline.lossy import read_lossy_blob, read_lossy_chain
from mithril_async.pipeline.pool import CodecPool
from mithril_async.restore.execute import DecodedVersion, ExecuteResources, Progress, execute
from mithril_async.restore.fresh import BaseLoader, FreshDecoder
from mithril_async.restore.plan import (
    VERIFY_MODES,
    LiveTargets,
    RestorePlan,
    make_plan,
    rank_ref,
)
from mithril_async.storage.capabilities import RemoteReads

__all__ = ["RESTORE_ERRORS", "DecodedVersion", "VersionReader", "read_tree_file",
           "read_version"]

log = logging.getLogger("mithril_async")

#: what a damaged version raises; ``fallback=True`` moves on to an older version on these
RESTORE_ERRORS = (ChecksumMismatch, InvalidFormat, KeyNotFound, MissingPrevious)
#: the in-flight budget of a reader without a config (a save's default)
DEFAULT_INFLIGHT_MIB = 256


class VersionReader:
    """Decode versions of one run, every checksum and delta base verified on the way.

    ``pool``: the codec threads that decode (the manager passes its own); tools leave it
    out and the reader makes (and on ``close()`` releases) a pool of its own.
    ``inflight_mib``: the bytes in flight a restore may hold (``max_inflight_mib``).
    ``progress(n)``: called (on any thread) with the raw bytes of the blobs it decodes whole
    into fresh tensors as they are decoded (:class:`~mithril_async.restore.fresh.FreshDecoder`:
    :meth:`check_blob`, and :meth:`read_version` with no live state), for a progress bar.
    """

    def __init__(self, catalog: RunCatalog, *, pool: Executor | None = None,
                 inflight_mib: float = DEFAULT_INFLIGHT_MIB,
                 progress: Callable[[int], None] | None = None) -> None:
        self.catalog = catalog
        self._own_pool: CodecPool | None = None
        if pool is None:
            from mithril_async.codec.state_dict import default_threads

            pool = self._own_pool = CodecPool(default_threads(), "mithril-reader")
        self.pool = pool
        self.inflight = int(inflight_mib * (1 << 20))
        self.decoder = FreshDecoder(pool, progress)
        #: for read(): bases decoded for one version are reused by the next
        self._loader = BaseLoader(catalog, self.decoder, "?")

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
        if not blob_format(ref.format, ref.key).lossless:
            await read_lossy_blob(self.catalog.store, ref, ref.bytes, self.pool)
            return None, {}
        self._loader.needed_by = ref.key  # named by errors about its bases
        return await self.decoder.read(self.catalog.store, ref, self._loader)

    async def check_blob(self, ref: BlobRef) -> None:
        """Verify one blob whole (every block, delta base and referenced tensor, and that it
        decodes to the raw size its manifest records) holding one tensor at a time: each is
        decoded with a loader of its own and dropped before the next, so memory stays at
        the blob plus one tensor whatever the blob claims (``mithril verify``)."""
        if not blob_format(ref.format, ref.key).lossless:  # checked and parsed only
            await self.read(ref)
            if self.decoder.progress is not None:
                self.decoder.progress(ref.raw_bytes)
            return
        async for _name, _tensor in self.decoder.read_each(
                self.catalog.store, ref, lambda: BaseLoader(self.catalog, self.decoder,
                                                            ref.key)):
            pass

    def plan(self, m: VersionManifest, *, rank: int = 0, world_size: int | None = None,
             items: Collection[str] | None = None, rng: bool = True,
             live: LiveTargets | None = None, verify: str = "block") -> RestorePlan:
        """The plan of restoring ``m`` (:func:`~mithril_async.restore.plan.make_plan`) for
        this reader's store."""
        store = self.catalog.store
        remote = isinstance(store, RemoteReads) and store.remote_reads
        return make_plan(m, rank=rank, world_size=world_size, items=items, rng=rng,
                         live=live, verify=verify, remote_reads=remote)

    async def read_version(self, target: str | int, *, rank: int = 0,
                           world_size: int | None = None, items: Collection[str] | None = None,
                           rng: bool = True, fallback: bool = False,
                           live: LiveTargets | None = None,
                           verify: str = "block") -> DecodedVersion:
        """Decode ``target`` ("latest", "best", "v000003", a step, a manifest key) for ``rank``.

        ``items``: the state items to decode (None: all). ``rng``: also read and verify the
        rank's RNG/state file (on a reshard every saved rank's, when the live state maps
        data-loader states). ``world_size``: the reading job's, when it will resume from
        the version: a version saved by another number of ranks is refused with a
        :class:`~mithril_async.errors.DistributedError` that says what is possible, unless
        its sharded items recorded their pieces and ``live`` takes them.
        ``live``: the live state restored into (:func:`~.plan.make_plan`).
        ``fallback``: if the target does not verify, the newest older version that does is
        returned (a warning names what was skipped); :class:`VersionNotFound` if none does.
        When the target failed after writing into the live state (``verify = "block"``),
        the older version must write over every item touched, else
        :class:`RestoreIncomplete`; any failure of that older version is
        :class:`RestoreIncomplete` too.
        """
        if verify not in VERIFY_MODES:
            raise ConfigError(f"restore verify = {verify!r}: must be one of "
                              f"{', '.join(map(repr, VERIFY_MODES))}")
        key = await self.catalog.resolve(target)
        kw: dict[str, Any] = dict(rank=rank, world_size=world_size, items=items, rng=rng,
                                  live=live, verify=verify)
        progress = Progress()
        try:
            return await self._decode(key, progress, **kw)
        except RESTORE_ERRORS as err:
            if not fallback:
                raise
            first_err: Exception = err
        except RestoreIncomplete as err:
            # one-pass restores find damage after writing: an older version written over
            # every item touched still leaves the live state whole (only then, and only
            # when what was touched is known)
            if not fallback or verify != "block" or not progress.items:
                raise
            first_err = err
        return await self._fall_back(key, first_err, set(progress.items), kw)

    async def _fall_back(self, key: str, first_err: Exception, touched: set[str],
                         kw: dict[str, Any]) -> DecodedVersion:
        """The newest version older than the one at ``key`` that verifies, written over
        every item the failed restore ``touched``."""
        bad_vid = key.rsplit("/", 2)[-2]
        try:
            bad_step: int | None = (await self.catalog.read_manifest(key)).step
        except RESTORE_ERRORS:  # the manifest itself is damaged: older version numbers
            bad_step = None
        for m in reversed(await self.catalog.versions(skip_damaged=True)):
            if (m.step >= bad_step if bad_step is not None
                    else version_number(m.version_id) >= version_number(bad_vid)):
                continue
            if m.held:  # NaN/Inf: only ever restored by its own id
                continue
            cand = self.catalog.layout.manifest_key(version_number(m.version_id))
            again = Progress()
            try:
                out = await self._decode(cand, again, **kw)
            except RESTORE_ERRORS as err:
                log.warning("fallback: %s does not verify either: %s", m.version_id, err)
                continue
            except RestoreIncomplete as err:
                if kw["verify"] != "block" or not again.items:
                    raise
                touched |= again.items
                log.warning("fallback: %s does not verify either (after writing %s): %s",
                            m.version_id, ", ".join(sorted(again.items)), err)
                continue
            except Exception as err:
                if not touched:
                    raise
                raise RestoreIncomplete(
                    f"restore of {bad_vid} failed after writing into the live state "
                    f"({', '.join(sorted(touched))}) and the fallback to the older "
                    f"{m.version_id} failed too ({type(err).__name__}: {err}): the live "
                    f"state is partially overwritten; first error: {first_err}") from err
            if touched:
                missing = sorted(touched - set(out.trees))
                if missing:
                    raise RestoreIncomplete(
                        f"restore of {bad_vid} failed after writing into the live state "
                        f"({', '.join(sorted(touched))}) and the older {m.version_id} has no "
                        f"{', '.join(missing)} to write over it: the live state is partially "
                        f"overwritten; cause: {first_err}") from first_err
                out.after_partial = str(first_err)
            log.warning("restore fell back from %s (%s) to %s (step %d)", bad_vid,
                        first_err, m.version_id, m.step)
            return out
        if touched:
            raise RestoreIncomplete(
                f"restore of {bad_vid} failed after writing into the live state "
                f"({', '.join(sorted(touched))}) and no older version verifies: the live "
                f"state is partially overwritten; first error: {first_err}") from first_err
        raise VersionNotFound(f"no version at or before {bad_vid} verifies; "
                              f"first error: {first_err}") from first_err

    def resources(self, version_id: str) -> ExecuteResources:
        """What the executor works with to write version ``version_id`` into live tensors:
        this reader's store, pool, decoder and in-flight budget, and a loader of its delta
        bases of its own (the bases it decodes are dropped with it)."""
        return ExecuteResources(self.catalog.store, self.pool, self.decoder,
                                BaseLoader(self.catalog, self.decoder, version_id),
                                self.inflight)

    async def _decode(self, key: str, progress: Progress, **kw: Any) -> DecodedVersion:
        m = await self.catalog.read_manifest(key)
        plan = self.plan(m, **kw)
        return await execute(plan, self.resources(m.version_id), progress, self.read_rng,
                             self._read_lossy)

    async def read_rng(self, m: VersionManifest, rank: int) -> dict[str, Any]:
        """The rank's RNG/state document of ``m``, checked against the manifest."""
        rng_ref = rank_ref(m, "rng", m.rng.keys, rank)
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
