"""The one reader: every restore path decodes committed versions through :class:`VersionReader`.

The manager's ``restore()``, the CLI (``restore``, ``verify``), the Hugging Face resume and any
tool built on the library read with the same code, so they verify the same things: the
manifest validates and names only keys of its run; every blob has its recorded xxh64 and every
chunk its own hash; delta bases and referenced tensors are followed only to versions that still
hold the exact blob the manifest recorded; the RNG/state file has its recorded xxh64 and was
saved at the manifest's step (a manifest carries no checksum of its own, so an altered step is
caught there). Reading never writes: no claims, no alias repairs.

Restoring into live objects (the manager passes their tensors): a version of the same layout
is decoded straight into the live tensors, in one pass with every block verified before it is
written (``verify="block"``, the default) or with every blob verified whole before the first
write (``verify="whole"``); sharded state whose manifest recorded its pieces restores on any
world size and mesh, each rank reading only the pieces (chunks) it needs
(:mod:`~mithril_async.pipeline.inplace`, :mod:`~mithril_async.pipeline.reshard`).

Lightning and DeepSpeed checkpoints are single files, not run versions: :func:`read_tree_file`
decodes those (the same container verification, no manifest).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import xxhash

from mithril_async.catalog import RunCatalog
from mithril_async.errors import (
    ChecksumMismatch,
    ConfigError,
    DistributedError,
    InvalidFormat,
    KeyNotFound,
    MissingPrevious,
    RestoreIncomplete,
    VersionNotFound,
)
from mithril_async.manifest import BlobRef, PieceMeta, ShardRef, VersionManifest, version_number
from mithril_async.pipeline.bases import BaseLoader
from mithril_async.pipeline.blobs import BlobCodec
from mithril_async.pipeline.inplace import (
    Progress,
    decode_into,
    guard_writes,
    takes_in_place,
    verify_blob,
)
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.pipeline.lossy import merge_lossy, read_lossy_blob, read_lossy_chain
from mithril_async.pipeline.pieces import open_item, write_item
from mithril_async.state import unflatten_state

__all__ = ["RESTORE_ERRORS", "DecodedVersion", "VersionReader", "read_tree_file", "read_version"]

log = logging.getLogger("mithril_async")
R = TypeVar("R")

#: what a damaged version raises; ``fallback=True`` moves on to an older version on these
RESTORE_ERRORS = (ChecksumMismatch, InvalidFormat, KeyNotFound, MissingPrevious)
#: how a restore verifies what it writes into the live state (``[checkpointing.restore]``)
VERIFY_MODES = ("block", "whole")


class _Decoded(NamedTuple):
    manifest: VersionManifest
    trees: dict[str, Any]
    #: the rank's RNG file (``rng``, ``states`` of get_state() objects, ``step``); empty when
    #: it was not asked for
    rng: dict[str, Any]


class DecodedVersion(_Decoded):
    """One version as a rank saved it: decoded state trees and its RNG/state document.

    Unpacks as the 3-tuple ``(manifest, trees, rng)`` it always was; what restores into the
    live state add rides along as attributes:

    - ``from_pieces``: sharded items restored from their recorded pieces, already written
      into the live local shards (their trees hold the targets' values, for
      ``load_resharded``);
    - ``rng_by_rank``: when the version was saved by another world size or mesh (a
      reshard), every saved rank's RNG/state document by saved rank (per-rank RNG and
      data-loader state mean nothing there: the caller decides); None otherwise;
    - ``in_place``: items whose every tensor was decoded straight into the live tensors
      (their trees hold those very tensors): loading them again copies nothing new.
    - ``after_partial``: set when this version was reached by ``fallback=True`` after the
      target failed with the live state partially overwritten (one-pass ``"block"``
      restores): the error that stopped the target. Every item it wrote is in ``trees``;
      loading them all makes the live state this version's, and a failure while loading
      leaves it mixed (the manager raises ``RestoreIncomplete`` then).
    """

    from_pieces: frozenset[str]
    rng_by_rank: dict[int, dict[str, Any]] | None
    in_place: frozenset[str]
    after_partial: str | None

    def __new__(cls, manifest: VersionManifest, trees: dict[str, Any], rng: dict[str, Any],
                from_pieces: frozenset[str] = frozenset(),
                rng_by_rank: dict[int, dict[str, Any]] | None = None,
                in_place: frozenset[str] = frozenset()) -> DecodedVersion:
        self = super().__new__(cls, manifest, trees, rng)
        self.from_pieces, self.rng_by_rank, self.in_place = from_pieces, rng_by_rank, in_place
        self.after_partial = None
        return self


#: ``reshard(item, saved pieces by tensor name)``: where this rank writes each tensor of a
#: sharded item (``distributed.ShardTarget``s), or None when the live object is not sharded
ReshardTargets = Callable[[str, dict[str, PieceMeta]], "dict[str, Any] | None"]
#: ``in_place(item)``: the live tensors of an item by stored name, to decode into (None: the
#: item is decoded into fresh tensors)
InPlaceTargets = Callable[[str], "Mapping[str, torch.Tensor] | None"]


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
                           rng: bool = True, fallback: bool = False,
                           reshard: ReshardTargets | None = None,
                           in_place: InPlaceTargets | None = None,
                           verify: str = "block") -> DecodedVersion:
        """Decode ``target`` ("latest", "best", "v000003", a step, a manifest key) for ``rank``.

        ``items``: the state items to decode (None: all). ``rng``: also read and verify the
        rank's RNG/state file. ``world_size``: the reading job's, when it will resume from the
        version: a version saved by another number of ranks is refused with a
        :class:`DistributedError` that says what is possible. ``fallback``: if the target does
        not verify, the newest older version that does is returned (a warning names what was
        skipped); :class:`VersionNotFound` if none does. ``reshard``: the live sharded
        items' targets (the manager's); with it, a version whose sharded items recorded their
        pieces restores on any world size and mesh (:meth:`_reshard`), writing those items
        straight into the live tensors. ``in_place``: the live tensors of each item; a
        version of the same layout is then decoded straight into them (MCKP blobs that are
        no delta, uncompressed blobs; :func:`~mithril_async.pipeline.inplace.decode_into`),
        block by block, each block verified before it is written; a failure after the first
        write raises :class:`~mithril_async.errors.RestoreIncomplete`.

        ``verify`` (:data:`VERIFY_MODES`), for what is decoded into the live tensors:
        ``"block"`` reads each MCKP blob once (each block verified before it is written; the
        manifest's whole-blob hash is not recomputed), so a damaged block can be found after
        others were written: ``RestoreIncomplete``; with ``fallback`` the newest older version that
        verifies is then restored over every item written (all of their tensors), and only
        if none does is ``RestoreIncomplete`` raised. Uncompressed blobs, which have no
        per-block hashes, are verified whole before their first write in both modes.
        ``"whole"`` verifies every blob whole before the first write (a damaged version
        leaves the live state untouched; a blob that changes between the two reads is
        ``RestoreIncomplete``, with no fallback), and over S3 decodes into fresh tensors.
        """
        if verify not in VERIFY_MODES:
            raise ConfigError(f"restore verify = {verify!r}: must be one of "
                              f"{', '.join(map(repr, VERIFY_MODES))}")
        key = await self.catalog.resolve(target)
        progress = Progress()
        try:
            return await self._decode(key, rank, world_size, items, rng, reshard, in_place,
                                      verify, progress)
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
        touched = set(progress.items)
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
            again = Progress()
            try:
                out = await self._decode(cand, rank, world_size, items, rng, reshard,
                                         in_place, verify, again)
            except RESTORE_ERRORS as err:
                log.warning("fallback: %s does not verify either: %s", m.version_id, err)
                continue
            except RestoreIncomplete as err:
                if verify != "block" or not again.items:
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

    async def _decode(self, key: str, rank: int, world_size: int | None,
                      items: Collection[str] | None, rng: bool,
                      reshard: ReshardTargets | None = None,
                      in_place: InPlaceTargets | None = None, verify: str = "block",
                      progress: Progress | None = None) -> DecodedVersion:
        m = await self.catalog.read_manifest(key)
        model_only = items is not None and set(items) == {"model"}
        if world_size is not None and reshard is not None:
            plan = self._targets(m, rank, world_size, items, reshard)
            if plan is not None:
                return await self._reshard(m, rank, items, rng, *plan, verify=verify,
                                           progress=progress)
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
        progress = Progress() if progress is None else progress
        # the in-flight budget of a save bounds a restore too, shared by the items
        budget = (self.codec.pipe.max_inflight_mib << 20) // max(1, len(refs))
        # A blob verified whole before its first write is read twice: over S3 the two passes
        # cost 3-4x a single read, so there such blobs are decoded into fresh tensors (one
        # pass, every block verified) and loaded as before. MCKP blobs restored one pass
        # (verify="block") go straight into the live tensors everywhere.
        remote = getattr(self.catalog.store, "remote_reads", False)

        def two_pass(ref: BlobRef) -> bool:
            return verify == "whole" or ref.format != "mckp"

        live = {name: t for name, ref in refs.items()
                if in_place is not None and not lossy and takes_in_place(ref)
                and not (remote and two_pass(ref)) and (t := in_place(name))}
        # Phase 1, nothing written yet: the RNG file, every blob decoded into the live
        # tensors in two passes verified whole (streamed), the others decoded into fresh
        # tensors as ever. Items run concurrently: one's reads and Python work overlap
        # another's decoding.
        rng_doc = await self.read_rng(m, rank) if rng else {}

        async def phase1(name: str, ref: BlobRef) -> tuple[Any, dict[str, torch.Tensor]] | None:
            if name in live:
                if two_pass(ref):
                    await verify_blob(self.catalog.store, ref, self.pool, budget)
                return None
            return await self.codec.read(self.catalog.store, ref, load_blob)

        first = await all_or_first_error([phase1(name, ref) for name, ref in refs.items()])
        decoded = dict(zip(refs, first, strict=True))
        # Phase 2: the blobs decoded straight into the live tensors, each block's hashes
        # checked before it is written (again, for a blob verified whole in phase 1: a blob
        # changed since is caught); once a byte is written, a failure is RestoreIncomplete:
        # partially overwritten. No item writes before every item's header checked out.
        done_in_place: set[str] = set()
        all_open = asyncio.Event()
        waiting = [len(live)]

        async def opened() -> None:  # no item writes before every item's header checked out
            waiting[0] -= 1
            if waiting[0] == 0:
                all_open.set()
            await all_open.wait()

        async def phase2(name: str) -> None:
            try:
                got = await decode_into(self.catalog.store, refs[name], live[name], self.pool,
                                        budget, m.version_id, progress, opened,
                                        verified=two_pass(refs[name]), step=m.step,
                                        item=name)
            finally:
                if refs[name].key in progress.written:
                    progress.items.add(name)
            assert got is not None  # takes_in_place(ref) was checked
            decoded[name] = got
            if all(live[name].get(n) is t for n, t in got[1].items()):
                done_in_place.add(name)

        with guard_writes(m.version_id, progress):
            await all_or_first_error([phase2(name) for name in live])
        trees = {}
        for name in refs:
            got = decoded[name]
            assert got is not None
            trees[name] = unflatten_state(got[0], merge_lossy(name, got[1], lossy))
        return DecodedVersion(m, trees, rng_doc, in_place=frozenset(done_in_place))

    def _targets(self, m: VersionManifest, rank: int, world_size: int,
                 items: Collection[str] | None, reshard: ReshardTargets
                 ) -> tuple[dict[str, dict[str, Any]], bool] | None:
        """The targets of every sharded item when this restore goes by pieces, and whether
        it is a reshard (another world size, or this rank's boxes differ from the same
        rank's saved ones). Pieces serve a same-layout restore too (decoded straight into
        the live local shards) when every per-rank item recorded them and nothing is lossy;
        None when the plain per-rank path restores the version."""
        per_rank = self._per_rank_items(m, items)
        targets: dict[str, dict[str, Any]] = {}
        for name, shards in per_rank.items():
            pieces = _merged_pieces(shards)
            if pieces is None:
                continue
            got = reshard(name, pieces)
            if got is not None:
                targets[name] = got
        if not targets:
            return None
        unsharded = sorted(n for n in per_rank if n not in targets)
        if m.world_size == world_size and all(_same_boxes(t, per_rank[name], rank)
                                              for name, t in targets.items()):
            return None if unsharded or m.lossy is not None else (targets, False)
        if unsharded:
            raise DistributedError(
                f"{m.version_id} was saved by {m.world_size} rank(s) and this job has "
                f"{world_size} (rank {rank}) or another mesh: its sharded items "
                f"({', '.join(sorted(targets))}) reshard, but {', '.join(unsharded)} "
                "is per-rank state without shard metadata, which cannot be remapped; restore "
                f"with {m.world_size} rank(s) and the same mesh, or leave it out of the state")
        if m.lossy is not None:
            raise DistributedError(f"{m.version_id} has lossy tensors, which decode only "
                                   "along their per-rank chain: restore it with "
                                   f"{m.world_size} rank(s) and the same mesh")
        return targets, True

    def _per_rank_items(self, m: VersionManifest, items: Collection[str] | None
                        ) -> dict[str, list[ShardRef]]:
        out: dict[str, list[ShardRef]] = {}
        if m.optimizer is not None:
            out["optimizer"] = list(m.optimizer.shards)
        out.update({name: list(shards) for name, shards in m.extra.items()})
        return {n: v for n, v in out.items() if items is None or n in items}

    async def _reshard(self, m: VersionManifest, rank: int, items: Collection[str] | None,
                       rng: bool, targets: dict[str, dict[str, Any]], resharded: bool, *,
                       verify: str, progress: Progress | None = None) -> DecodedVersion:
        """Restore sharded items from their pieces (``resharded``: on another world size or
        mesh; else the same layout, each rank reading its own pieces): every item's pieces
        planned, checked and its blobs opened (:func:`~mithril_async.pipeline.pieces.open_item`),
        the unsharded model (rank 0's) decoded as usual, the RNG/state documents read (every
        saved rank's for a reshard), all before the first write; then each item's needed
        chunks are streamed straight into the live local shards
        (:func:`~mithril_async.pipeline.pieces.write_item`, memory bounded by the budget).
        Damage found before the first write leaves the live state untouched; after it,
        :class:`~mithril_async.errors.RestoreIncomplete` (``progress`` names what was
        written, for the fallback)."""
        load_blob = BaseLoader(self.catalog, self.codec, m.version_id)
        per_rank = self._per_rank_items(m, items)
        trees: dict[str, Any] = {}
        progress = Progress() if progress is None else progress

        async def whole_model() -> None:
            skeleton, tensors = await self.codec.read(self.catalog.store, m.model, load_blob)
            trees["model"] = unflatten_state(skeleton, tensors)

        budget = (self.codec.pipe.max_inflight_mib << 20) // max(1, len(targets))
        store = self.catalog.store
        jobs: list[Coroutine[Any, Any, Any]] = [
            open_item(self.codec, store, m.version_id, m.step, name,
                      {s.rank: s for s in per_rank[name]}, tgts, load_blob, budget, verify)
            for name, tgts in targets.items()]
        if "model" not in per_rank and (items is None or "model" in items):
            jobs.append(whole_model())
        # everything planned, checked and opened (items and saved ranks concurrently)
        # before the first byte is written into the live state
        opened = (await all_or_first_error(jobs))[:len(targets)]
        by_rank: dict[int, dict[str, Any]] = {}
        if rng:  # a reshard maps every saved rank's; the same layout takes its own
            keys = m.rng.keys if resharded else [_rank_ref(m, "rng", m.rng.keys, rank)]
            docs = await all_or_first_error([self.read_rng(m, k.rank) for k in keys])
            by_rank = {k.rank: d for k, d in zip(keys, docs, strict=True)}
        with guard_writes(m.version_id, progress):
            await all_or_first_error([write_item(o, store, self.pool, budget, progress)
                                      for o in opened])
        for o in opened:
            trees[o.item] = unflatten_state(o.skeleton, {n: t.value for n, t in
                                                         targets[o.item].items()})
        return DecodedVersion(m, trees, by_rank.get(rank, {}), frozenset(targets),
                              by_rank if resharded else None)

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


def _merged_pieces(shards: Sequence[ShardRef]) -> dict[str, PieceMeta] | None:
    """Every tensor's piece (global shape, dtype) of a per-rank item, when every rank
    recorded pieces for the same tensors; None when the item cannot be resharded."""
    if not shards or any(not s.pieces for s in shards):
        return None
    names = set(shards[0].pieces)
    if any(set(s.pieces) != names for s in shards):
        return None
    return dict(shards[0].pieces)


def _same_boxes(targets: dict[str, Any], shards: Sequence[ShardRef], rank: int) -> bool:
    """Whether this rank needs exactly the boxes the same rank saved (same layout)."""
    mine = next((s for s in shards if s.rank == rank), None)
    if mine is None:
        return False
    for name, t in targets.items():
        p = mine.pieces.get(name)
        if p is None or (tuple(p.offsets), tuple(p.lengths)) != (t.box.offsets, t.box.lengths):
            return False
    return True


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
