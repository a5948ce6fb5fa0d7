"""Carry out a :class:`~mithril_async.restore.plan.RestorePlan`: open everything, then write.

Two phases, so that damage found early never touches the live state:

1. **Open**, nothing written: the RNG/state files (each by its manifest hash), the lossy
   chain, every blob decoded into fresh tensors, and every blob to be written into the live
   state opened and checked (:mod:`~mithril_async.restore.sources`: size, trailer, header,
   index, tiling, binding to its manifest entry, live shapes; verified whole first where the
   plan says so). Items and blobs run concurrently: one's reads overlap another's decoding.
2. **Write**: the opened blobs streamed into the live tensors
   (:mod:`~mithril_async.restore.block_decode`), every block verified before it is written.

Damage found in phase 1 raises its own typed error with the live state untouched. Once a
byte is written, any failure is :class:`~mithril_async.errors.RestoreIncomplete` naming
what was written (:class:`Progress`, :class:`guard_writes`), so the caller's fallback knows
which items to write over; it is never returned as restored, and no decode still runs on a
codec thread when it is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from mithril_async.codec.container import MckpInfo
from mithril_async.codec.formats import blob_format
from mithril_async.errors import InvalidFormat, KeyNotFound, MissingPrevious, RestoreIncomplete
from mithril_async.manifest import VersionManifest
from mithril_async.pipeline.blobs import skeleton_of
from mithril_async.pipeline.loop import all_or_first_error
from mithril_async.pipeline.lossy import merge_lossy
from mithril_async.restore.block_decode import copy_safetensors_into, decode_mckp_into, write_pieces
from mithril_async.restore.fresh import FreshDecoder, LoadBlob
from mithril_async.restore.plan import BlobRead, PieceSource, PiecesRead, RestorePlan
from mithril_async.restore.sources import (
    SafetensorsInfo,
    check_binding,
    check_size,
    check_tiling,
    open_mckp,
    open_safetensors,
    verify_blob,
)
from mithril_async.restore.targets import check_shapes, mark_written
from mithril_async.state import unflatten_state
from mithril_async.storage.base import Store

__all__ = ["DecodedVersion", "ExecuteResources", "OpenedItem", "Progress", "execute",
           "guard_writes", "open_item", "write_item"]


@dataclass
class Progress:
    """What a restore has written into the live state so far (for its failure message)."""

    written: list[str] = field(default_factory=list)
    #: the state items written into (some of their tensors may hold their old values)
    items: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def touched(self) -> bool:
        return bool(self.written)

    def starter(self, item: str, key: str) -> Callable[[], None]:
        """What a writer calls (on any thread) right before it writes ``key``'s bytes."""
        def started() -> None:
            with self._lock:
                if key not in self.written:
                    self.written.append(key)
                self.items.add(item)

        return started


class guard_writes:
    """Turn an error into :class:`RestoreIncomplete` once the live state has been written."""

    def __init__(self, version: str, progress: Progress) -> None:
        self.version, self.progress = version, progress

    def __enter__(self) -> guard_writes:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: Any) -> None:
        if e is None or not self.progress.touched or isinstance(e, RestoreIncomplete):
            return
        if isinstance(e, Exception):
            raise RestoreIncomplete(
                f"restore of {self.version} failed after writing into the live state "
                f"({', '.join(self.progress.written)}): it is partially overwritten; "
                f"cause: {type(e).__name__}: {e}") from e


class _Decoded(NamedTuple):
    manifest: VersionManifest
    trees: dict[str, Any]
    #: the rank's RNG file (``rng``, ``states`` of get_state() objects, ``step``); empty when
    #: it was not asked for
    rng: dict[str, Any]


class DecodedVersion(_Decoded):
    """One version as a rank saved it: decoded state trees and its RNG/state document.

    Unpacks as the 3-tuple ``(manifest, trees, rng)``; what restores into the live state add
    rides along as attributes:

    - ``from_pieces``: sharded items restored from their recorded pieces, already written
      into the live local shards (their trees hold the targets' values, for
      ``load_resharded``);
    - ``rng_by_rank``: when the version was saved by another world size or mesh (a
      reshard), every saved rank's RNG/state document by saved rank (per-rank RNG and
      data-loader state mean nothing there: the caller decides); None otherwise;
    - ``in_place``: items whose every tensor was decoded straight into the live tensors
      (their trees hold those very tensors);
    - ``after_partial``: set when this version was reached by a fallback after the target
      failed with the live state partially overwritten: the error that stopped the target.
      Every item it wrote is in ``trees``; loading them all makes the live state this
      version's, and a failure while loading leaves it mixed.
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


_For = TypeVar("_For", BlobRead, PieceSource)


@dataclass
class _OpenedBlob(Generic[_For]):
    """A blob the plan reads, opened for writing: what it was opened for (a whole blob's
    read, or a saved piece to copy from), its skeleton and the header the writer needs."""

    what: _For
    skeleton: Any
    mckp: MckpInfo | None = None
    st: SafetensorsInfo | None = None
    #: a piece decoded whole into fresh tensors (a delta, or one referencing other versions)
    tensors: dict[str, torch.Tensor] | None = None


@dataclass
class ExecuteResources:
    """What the executor works with: the store, the codec pool, the fresh decoder, the
    loader of delta bases, and the bytes a restore may hold in flight."""

    store: Store
    pool: Executor
    decoder: FreshDecoder
    load_blob: LoadBlob
    inflight: int


#: reads the small files of a version for one saved rank (RNG/state documents, lossy tensors)
RankReader = Callable[[VersionManifest, int], Coroutine[Any, Any, dict[str, Any]]]


@dataclass
class OpenedItem:
    """A sharded item of a plan with every saved blob it reads opened, nothing written."""

    read: PiecesRead
    sources: list[_OpenedBlob[PieceSource]]

    @property
    def skeleton(self) -> Any:
        return self.sources[0].skeleton


async def execute(plan: RestorePlan, ctx: ExecuteResources, progress: Progress,
                  read_rng: RankReader, read_lossy: RankReader) -> DecodedVersion:
    """Open everything ``plan`` reads, then write it into the live state (module
    docstring); the decoded version."""
    m = plan.manifest
    budget = ctx.inflight // max(1, len(plan.pieces) or len(plan.blobs))
    rng_docs = await all_or_first_error([read_rng(m, r) for r in plan.rng_ranks])
    by_rank = dict(zip(plan.rng_ranks, rng_docs, strict=True))
    lossy = {} if plan.lossy_rank is None else await read_lossy(m, plan.lossy_rank)
    fresh: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}

    async def decode_fresh(item: str, ref: Any) -> None:
        fresh[item] = await ctx.decoder.read(ctx.store, ref, ctx.load_blob)

    jobs: list[Coroutine[Any, Any, Any]] = [decode_fresh(b.item, b.ref) for b in plan.blobs
                                            if b.live is None]
    if plan.whole_model is not None:
        jobs.append(decode_fresh("model", plan.whole_model))
    blob_opens = [b for b in plan.blobs if b.live is not None]
    jobs += [_open_blob(ctx, b, m.step, budget) for b in blob_opens]
    jobs += [open_item(ctx, p, m.version_id, m.step, plan.verify, budget)
             for p in plan.pieces]
    opened = await all_or_first_error(jobs)
    opened_blobs: list[_OpenedBlob[BlobRead]] = [o for o in opened if isinstance(o, _OpenedBlob)]
    opened_items = [o for o in opened if isinstance(o, OpenedItem)]
    written: dict[str, dict[str, torch.Tensor]] = {}

    async def write_blob(o: _OpenedBlob[BlobRead]) -> None:
        b = o.what
        assert b.live is not None
        started = progress.starter(b.item, b.ref.key)
        if o.mckp is not None:
            written[b.item] = await decode_mckp_into(ctx.store, b.ref, o.mckp, b.live,
                                                     ctx.pool, budget, started)
        else:
            assert o.st is not None
            written[b.item] = await copy_safetensors_into(ctx.store, b.ref, o.st, b.live,
                                                          ctx.pool, budget, started)

    with guard_writes(m.version_id, progress):
        await all_or_first_error(
            [*(write_blob(o) for o in opened_blobs),
             *(write_item(ctx, o, progress, budget) for o in opened_items)])
    trees: dict[str, Any] = {}
    in_place: set[str] = set()
    for b in plan.blobs:
        if b.live is None:
            skeleton, tensors = fresh[b.item]
        else:
            skeleton = next(o.skeleton for o in opened_blobs if o.what is b)
            tensors = written[b.item]
            if all(b.live.get(n) is t for n, t in tensors.items()):
                in_place.add(b.item)
        trees[b.item] = unflatten_state(skeleton, merge_lossy(b.item, tensors, lossy))
    if plan.whole_model is not None:
        trees["model"] = unflatten_state(*fresh["model"])
    for o in opened_items:
        trees[o.read.item] = unflatten_state(o.skeleton, {n: t.value for n, t in
                                                          o.read.targets.items()})
    return DecodedVersion(m, trees, by_rank.get(plan.rank, {}),
                          frozenset(p.item for p in plan.pieces),
                          by_rank if plan.resharded else None, frozenset(in_place))


async def _open_blob(ctx: ExecuteResources, b: BlobRead, step: int, budget: int
                     ) -> _OpenedBlob[BlobRead]:
    """Open one blob to be written in place (nothing written): verified whole first where
    the plan says so, its head checked, the live shapes the saved ones."""
    ref = b.ref
    assert b.live is not None
    if b.verify_first:
        await verify_blob(ctx.store, ref, ctx.pool, budget)
    size = await check_size(ctx.store, ref)
    if not blob_format(ref.format, ref.key).block_hashes:
        st = await open_safetensors(ctx.store, ref)
        check_shapes(ref.key, b.live, ((e.name, e.shape) for e in st.entries))
        return _OpenedBlob(b, st.skeleton, st=st)
    info = await open_mckp(ctx.store, ref, size)
    skeleton = skeleton_of(info.metadata, ref.key)
    check_shapes(ref.key, b.live, ((t.name, t.shape) for t in info.tensors))
    if not b.verify_first:
        check_tiling(ref.key, info, sorted(info.index.values(), key=lambda r: r.offset))
        check_binding(ref.key, info, step, b.item)
    return _OpenedBlob(b, skeleton, mckp=info)


async def open_item(ctx: ExecuteResources, p: PiecesRead, version: str, step: int, verify: str,
                    budget: int) -> OpenedItem:
    """Open every saved blob a sharded item reads (nothing written): each must exist with
    its recorded size before any is read, then each is opened and every tensor taken from
    it must have the dtype and shape the manifest records for its piece."""
    for src in p.sources:
        try:
            await check_size(ctx.store, src.ref)
        except KeyNotFound:
            what = f"tensor {next(iter(src.runs))!r}" if src.runs else "the state skeleton"
            raise MissingPrevious(f"{version}: rank {src.rank}'s {p.item} blob "
                                  f"{src.ref.key} (holding {what}) is missing") from None
    share = max(1, budget // len(p.sources))  # blobs verified whole stream concurrently
    return OpenedItem(p, list(await all_or_first_error(
        [_open_source(ctx, p, src, step, verify, share) for src in p.sources])))


async def _open_source(ctx: ExecuteResources, p: PiecesRead, src: PieceSource, step: int,
                       verify: str, budget: int) -> _OpenedBlob[PieceSource]:
    ref = src.ref
    fmt = blob_format(ref.format, ref.key)
    if fmt.in_place and ref.base is None and not ref.refs and fmt.block_hashes:
        if verify == "whole":
            await verify_blob(ctx.store, ref, ctx.pool, budget)
        info = await open_mckp(ctx.store, ref, ref.bytes)
        check_tiling(ref.key, info, sorted(info.index.values(), key=lambda b: b.offset))
        check_binding(ref.key, info, step, p.item)
        found = {t.name: (t.dtype, tuple(t.shape)) for t in info.tensors}
        opened = _OpenedBlob(src, skeleton_of(info.metadata, ref.key), mckp=info)
    elif fmt.in_place and ref.base is None and not ref.refs:
        # safetensors: one whole-file hash, checked before any use
        await verify_blob(ctx.store, ref, ctx.pool, budget)
        st = await open_safetensors(ctx.store, ref)
        found = {e.name: (e.dtype, e.shape) for e in st.entries}
        opened = _OpenedBlob(src, st.skeleton, st=st)
    else:
        skeleton, tensors = await ctx.decoder.read(ctx.store, ref, ctx.load_blob,
                                                   only=frozenset(src.runs))
        found = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                 for n, t in tensors.items()}
        opened = _OpenedBlob(src, skeleton,
                             tensors={n: t.contiguous() for n, t in tensors.items()})
    for name in src.runs:
        saved = ref.piece(name)
        want = (str(p.targets[name].dtype).removeprefix("torch."),
                tuple(saved.lengths) if saved is not None else ())
        got = found.get(name)
        if got is None:
            raise InvalidFormat(f"{p.item}: rank {src.rank}'s blob lacks tensor {name!r} its "
                                "manifest entry lists")
        if got != want:
            raise InvalidFormat(f"{p.item}: rank {src.rank}'s tensor {name!r} is "
                                f"{got[0]}{list(got[1])}, its manifest entry says "
                                f"{want[0]}{list(want[1])}")
    return opened


async def write_item(ctx: ExecuteResources, opened: OpenedItem, progress: Progress, budget: int
                     ) -> None:
    """Stream every opened blob's needed bytes into the live local shards; the blobs
    concurrently, the budget shared among them."""
    p, sources = opened.read, opened.sources
    share = max(1, budget // max(1, len(sources)))
    try:
        await all_or_first_error([
            write_pieces(ctx.store, o.what.ref, o.what.runs, o.mckp, o.st, o.tensors,
                         ctx.pool, share, progress.starter(p.item, o.what.ref.key))
            for o in sources if o.what.runs])
    finally:  # what was written is written, whatever stopped the rest
        if p.item in progress.items:
            mark_written(t.local for t in p.targets.values())
