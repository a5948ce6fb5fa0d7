"""What a restore of one version reads for one rank, and where each byte goes: the plan.

Every restore path is planned here first, with no I/O, into one typed :class:`RestorePlan`:

- **blobs** (:class:`BlobRead`): an item saved by this rank's counterpart (same layout),
  either decoded straight into the live tensors (``live``; MCKP or safetensors blobs that
  are no delta, when the live state offers tensors for it) or into fresh tensors (``live``
  None: deltas, blobs referencing other versions, lossy versions, tools with no live state,
  blobs over a network that would need two reads). ``verify_first``: the blob is verified
  whole before its first write (``verify = "whole"``, or a format without per-block hashes).
- **pieces** (:class:`PiecesRead`): a sharded item restored from the pieces every saved rank
  recorded, on any world size and mesh: for each saved blob the plan names (the lowest saved
  rank's always: it holds the item's skeleton) the copy runs of every tensor into this
  rank's live local shards, from the overlap arithmetic (:mod:`~mithril_async.restore.reshard`).
  A hole in the saved coverage, or a live global shape that differs, is refused here.
- **whole_model**: in a pieces restore, the unsharded model (rank 0's), decoded fresh.
- **rng_ranks**: whose RNG/state files are read (this rank's; every saved rank's for a reshard).

:meth:`RestorePlan.keys` is every file the restore reads, so other layers (the tiers' recovery)
fetch exactly what the reader will read. The executor (:mod:`~mithril_async.restore.execute`)
carries a plan out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from mithril_async.codec.formats import blob_format
from mithril_async.errors import DistributedError, ShapeMismatch
from mithril_async.manifest import BlobRef, PieceMeta, ShardRef, VersionManifest, gc_paused
from mithril_async.restore.piece_index import PieceIndex
from mithril_async.restore.reshard import copy_runs, plan_reads
from mithril_async.restore.targets import CopyRuns

__all__ = ["VERIFY_MODES", "BlobRead", "LiveTargets", "PieceSource", "PiecesRead",
           "ReshardTargets", "RestorePlan", "make_plan", "per_rank_items", "pieces_read",
           "rank_ref"]



class _Ranked(Protocol):
    @property
    def rank(self) -> int: ...


R = TypeVar("R", bound=_Ranked)

#: how a restore verifies what it writes into the live state (``[checkpointing.restore]``)
VERIFY_MODES = ("block", "whole")

#: ``reshard(item, saved pieces by tensor name)``: where this rank writes each tensor of a
#: sharded item (``distributed.ShardTarget``s), or None when the live object is not sharded
ReshardTargets = Callable[[str, dict[str, PieceMeta]], "dict[str, Any] | None"]


class LiveTargets(Protocol):
    """What a plan asks of the live state it restores into (the manager's
    :class:`~mithril_async.restore.apply.LiveRestore`; :class:`~mithril_async.live.LiveState`
    for any mapping of live objects)."""

    @property
    def has_json_states(self) -> bool:
        """Some item is a data-loader state: a reshard maps every saved rank's."""

    def reshard_targets(self, item: str, pieces: dict[str, PieceMeta]
                        ) -> dict[str, Any] | None:
        """Where this rank writes each tensor of a sharded item; None: not sharded."""

    def in_place_targets(self, item: str) -> Mapping[str, torch.Tensor] | None:
        """The live tensors of an item by stored name, to decode straight into (None: it is
        decoded into fresh tensors)."""


@dataclass(frozen=True)
class BlobRead:
    """One item read from one blob (same layout); see the module docstring."""

    item: str
    ref: BlobRef
    live: Mapping[str, torch.Tensor] | None = None
    verify_first: bool = False


@dataclass(frozen=True)
class PieceSource:
    """One saved rank's blob of a sharded item and the copy runs this rank takes from it
    (empty for the lowest saved rank when it is read for the skeleton alone)."""

    rank: int
    ref: ShardRef
    runs: dict[str, CopyRuns] = field(default_factory=dict)


@dataclass(frozen=True)
class PiecesRead:
    """A sharded item restored from saved pieces; ``sources`` by saved rank, the first
    holding the item's skeleton; ``targets``: name -> ``distributed.ShardTarget``."""

    item: str
    sources: tuple[PieceSource, ...]
    targets: Mapping[str, Any]


@dataclass(frozen=True)
class RestorePlan:
    """Everything one rank's restore of one version reads and writes (module docstring)."""

    manifest: VersionManifest
    rank: int
    verify: str
    blobs: tuple[BlobRead, ...] = ()
    pieces: tuple[PiecesRead, ...] = ()
    whole_model: BlobRef | None = None
    rng_ranks: tuple[int, ...] = ()
    #: the version was saved by another world size or mesh
    resharded: bool = False
    #: whose lossy blob completes the tensors (None: the version is lossless)
    lossy_rank: int | None = None

    def keys(self) -> list[str]:
        """Every file this restore reads (blobs and RNG files), in a stable order. Delta
        bases and referenced tensors of other versions are followed at decode time."""
        m = self.manifest
        out = [b.ref.key for b in self.blobs]
        out += [s.ref.key for p in self.pieces for s in p.sources]
        if self.whole_model is not None:
            out.append(self.whole_model.key)
        if self.lossy_rank is not None and m.lossy is not None:
            out += [s.key for s in m.lossy.shards if s.rank == self.lossy_rank]
        out += [k.key for k in m.rng.keys if k.rank in self.rng_ranks]
        return list(dict.fromkeys(out))


@gc_paused()  # thousands of small objects and no cycle among them: collected once after
def make_plan(m: VersionManifest, *, rank: int = 0, world_size: int | None = None,
              items: Collection[str] | None = None, rng: bool = True,
              live: LiveTargets | None = None, verify: str = "block",
              remote_reads: bool = False) -> RestorePlan:
    """Plan the restore of ``m`` for ``rank`` of a job of ``world_size`` ranks (None: a
    tool reading what rank ``rank`` saved). ``items``: the state items to restore (None:
    all); ``rng``: also read the RNG/state file(s); ``live``: the live state restored into
    (None: a tool's read into fresh tensors), whose sharded items take their pieces on any
    world size and whose other tensors are decoded into where they can; a reshard reads
    every saved rank's RNG/state file when the live state has data-loader states (or
    without a live state), else only this rank's, or the lowest saved rank's for a rank
    that did not exist (its RNG is reseeded from it); ``remote_reads``: the store's reads cross a
    network, where a blob needing two reads is decoded fresh in one verified pass instead."""
    all_rank_states = True if live is None else live.has_json_states
    if world_size is not None and live is not None:
        sharded = _pieces_targets(m, rank, world_size, items, live.reshard_targets)
        if sharded is not None:
            return _pieces_plan(m, rank, items, rng, all_rank_states, verify, *sharded)
    model_only = items is not None and set(items) == {"model"}
    if world_size is not None:
        _check_world_size(m, model_only, rank, world_size)
    refs: dict[str, BlobRef] = {} if m.model is None else {"model": m.model}
    if m.optimizer is not None and not model_only:
        refs["optimizer"] = rank_ref(m, "optimizer", m.optimizer.shards, rank)
    for name, shards in m.extra.items():
        if not model_only or name == "model":
            refs[name] = rank_ref(m, name, shards, rank)
    if items is not None:
        refs = {name: ref for name, ref in refs.items() if name in items}
    lossy_rank = None
    if m.lossy is not None:  # a model-only load across world sizes: rank 0's lossy blob
        lossy_rank = rank if world_size is None or m.world_size == world_size else 0
    reads = []
    for name, ref in refs.items():
        fmt = blob_format(ref.format, ref.key)
        two_pass = verify == "whole" or not fmt.block_hashes
        in_place_ok = (live is not None and lossy_rank is None and fmt.in_place
                       and ref.base is None and not ref.refs and not (remote_reads and two_pass))
        into = live.in_place_targets(name) if in_place_ok and live is not None else None
        if into:
            reads.append(BlobRead(name, ref, into, verify_first=two_pass))
        else:
            reads.append(BlobRead(name, ref))
    return RestorePlan(m, rank, verify, blobs=tuple(reads),
                       rng_ranks=(rank,) if rng else (), lossy_rank=lossy_rank)


def per_rank_items(m: VersionManifest, items: Collection[str] | None
                   ) -> dict[str, list[ShardRef]]:
    """Every per-rank item of ``m`` (optimizer shards, extras) by name, ``items`` only."""
    out: dict[str, list[ShardRef]] = {}
    if m.optimizer is not None:
        out["optimizer"] = list(m.optimizer.shards)
    out.update({name: list(shards) for name, shards in m.extra.items()})
    return {n: v for n, v in out.items() if items is None or n in items}


def _pieces_targets(m: VersionManifest, rank: int, world_size: int,
                    items: Collection[str] | None, reshard: ReshardTargets
                    ) -> tuple[dict[str, dict[str, Any]], bool] | None:
    """The targets of every sharded item when this restore goes by pieces, and whether it
    is a reshard (another world size, or this rank's boxes differ from the same rank's
    saved ones). Pieces serve a same-layout restore too (decoded straight into the live
    local shards) when every per-rank item recorded them and nothing is lossy; None when the
    plain per-rank path restores the version."""
    per_rank = per_rank_items(m, items)
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


def _pieces_plan(m: VersionManifest, rank: int, items: Collection[str] | None, rng: bool,
                 all_rank_states: bool, verify: str, targets: dict[str, dict[str, Any]],
                 resharded: bool) -> RestorePlan:
    per_rank = per_rank_items(m, items)
    pieces = tuple(pieces_read(name, {s.rank: s for s in per_rank[name]}, tgts)
                   for name, tgts in targets.items())
    whole = m.model if m.model is not None and "model" not in per_rank and (
        items is None or "model" in items) else None
    rng_ranks: tuple[int, ...] = ()
    if rng and resharded and all_rank_states:  # every saved rank's states are mapped
        rng_ranks = tuple(k.rank for k in m.rng.keys)
    elif rng and resharded:  # its own RNG, or the lowest saved rank's to reseed from
        saved = {k.rank for k in m.rng.keys}
        rng_ranks = (rank if rank in saved else min(saved),)
    elif rng:  # the same layout takes its own
        rng_ranks = (rank_ref(m, "rng", m.rng.keys, rank).rank,)
    return RestorePlan(m, rank, verify, pieces=pieces, whole_model=whole,
                       rng_ranks=rng_ranks, resharded=resharded)


def pieces_read(item: str, refs: Mapping[int, ShardRef], targets: Mapping[str, Any]
                  ) -> PiecesRead:
    """Which saved blobs of ``item`` this rank reads and the copy runs of each tensor from
    each: a live global shape other than the saved one is :class:`ShapeMismatch`, a box the
    saved pieces leave uncovered :class:`~mithril_async.errors.MissingPrevious`."""
    index = PieceIndex(refs)
    first = min(refs)
    sources: dict[int, PieceSource] = {first: PieceSource(first, refs[first])}
    for name, tgt in targets.items():
        other = index.shape_mismatch(name, tgt.global_shape)
        if other is not None:
            raise ShapeMismatch(f"{item}: tensor {name!r} is {list(tgt.global_shape)} here "
                                f"but rank {other[0]} saved it as part of {other[1]}")
        for rd in plan_reads(f"{item}/{name}", tgt.box, index.overlapping(name, tgt.box)):
            if rd.rank not in sources:
                sources[rd.rank] = PieceSource(rd.rank, refs[rd.rank])
            src = sources[rd.rank]
            runs = copy_runs(rd.src, tgt.box, rd.overlap, tgt.local.element_size())
            src.runs[name] = CopyRuns.of(runs, tgt.local)
    return PiecesRead(item, tuple(sources[r] for r in sorted(sources)), targets)


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
    if not shards:
        return None
    names = shards[0].piece_names()
    seen: set[str] = set()
    for s in shards:  # blobs of one piece layout name the same tensors: compared once
        if s.layout in seen:
            continue
        if s.layout is not None:
            seen.add(s.layout)
        elif not s.pieces:
            return None
        if s.piece_names() != names:
            return None
    return shards[0].piece_table()


def _same_boxes(targets: dict[str, Any], shards: Sequence[ShardRef], rank: int) -> bool:
    """Whether this rank needs exactly the boxes the same rank saved (same layout)."""
    mine = next((s for s in shards if s.rank == rank), None)
    if mine is None:
        return False
    for name, t in targets.items():
        p = mine.piece(name)
        if p is None or (tuple(p.offsets), tuple(p.lengths)) != (t.box.offsets, t.box.lengths):
            return False
    return True


def rank_ref(m: VersionManifest, what: str, refs: Sequence[R], rank: int) -> R:
    """The rank's entry of a per-rank list, or a clear error about the world size."""
    for ref in refs:
        if ref.rank == rank:
            return ref
    raise DistributedError(
        f"{m.version_id} was saved by {m.world_size} rank(s) and has no {what} shard for "
        f"rank {rank}; restore with the same world size, or load the model only "
        "(restore(..., load='model')) on rank 0")
