"""Delta chains and deduplication across versions, as the manager encodes them.

Policy (benchmarks/bench_delta.py compares the alternatives): each version is XOR-encoded
against the previous committed version, with a full keyframe every ``keyframe_interval``
versions, so a restore reads at most ``keyframe_interval`` blobs of the chain. The base is kept
in host memory by double-buffering the staging area: one buffer set holds the last committed
snapshot (the base), the other receives the next snapshot; after a commit they swap. This costs
one extra copy of the state in host memory and no I/O; a failed save leaves the base untouched.

``delta_base = "keyframe"`` XORs every delta against the chain's keyframe instead: the buffers
do not swap after a delta commits (the keyframe's snapshot stays the base), so a restore reads
at most two blobs whatever the interval, at the price of deltas that grow with the distance to
the keyframe.

Tensors bitwise unchanged since the previous version (frozen layers, embeddings, LoRA bases)
are not stored again: the blob references the blob holding their last full copy (verified by
xxh64 of the tensor's raw bytes at restore), in keyframes and deltas alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.dtypes import dtype_name, tensor_bytes
from mithril_async.config import CompressionConfig
from mithril_async.manifest import BaseRef, BlobRef
from mithril_async.pipeline.blobs import TensorRef
from mithril_async.save.buffers import BufferSet

if TYPE_CHECKING:
    import torch

    from mithril_async.codec.dtypes import RawTensor

    #: a staged tensor: a torch tensor in the trainer, a view of its staging memory in a
    #: checkpoint worker
    Staged = torch.Tensor | RawTensor
from mithril_async.save.items import EncodePlan
from mithril_async.save.xor_choice import delta_pays


@dataclass(frozen=True)
class ChainPolicy:
    delta: bool = False
    dedup: bool = False
    keyframe_interval: int = 8
    delta_base: str = "previous"  # or "keyframe"
    #: a tensor is a delta only if estimated to save this much of its full size (xor_choice)
    min_gain: float = 0.0
    byte_grouping: bool = True

    @classmethod
    def of(cls, comp: CompressionConfig) -> ChainPolicy:
        """The chain policy ``[checkpointing.compression]`` sets (none without compression)."""
        return cls(
            delta=comp.delta and comp.enabled,
            dedup=(comp.delta if comp.dedup is None else comp.dedup) and comp.enabled,
            keyframe_interval=comp.keyframe_interval, delta_base=comp.delta_base,
            min_gain=comp.effective_delta_min_gain, byte_grouping=comp.byte_grouping)

    @property
    def double_buffer(self) -> bool:
        return self.delta or self.dedup


@dataclass
class ItemChain:
    """One state item's chain: staging buffers and what the last committed version holds."""

    policy: ChainPolicy
    #: the buffer sets snapshots are staged into (two when the last one is a delta base)
    areas: list[BufferSet] = field(default_factory=list)
    base_idx: int | None = None
    base_blob: BaseRef | None = None
    #: blobs a restore of the base reads along its chain (1 = the base is a keyframe)
    chain_len: int = 0
    #: tensors of the base with a full copy somewhere (dedup targets)
    phys: dict[str, TensorRef] = field(default_factory=dict)
    #: (NaNs, Infs) of the base's tensors that hold any: a tensor referenced instead of
    #: stored again keeps them
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.areas:
            self.areas = [BufferSet() for _ in range(2 if self.policy.double_buffer else 1)]

    @property
    def write_idx(self) -> int:
        """The buffer set the next snapshot goes into (never the base's)."""
        if len(self.areas) == 1 or self.base_idx is None:
            return 0
        return 1 - self.base_idx

    def reset(self) -> None:
        """Forget the base (after a restore): the next version is a keyframe."""
        self.base_idx, self.base_blob, self.chain_len = None, None, 0
        self.phys = {}
        self.nonfinite = {}

    def release(self) -> None:
        for a in self.areas:
            a.release()


def _raw(t: Staged) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return tensor_bytes(t)[0]


def plan_item(chain: ItemChain, tensors: dict[str, Staged]
              ) -> tuple[EncodePlan, dict[str, int]]:
    """Decide per tensor: reference (unchanged), XOR delta against the base (when that is
    estimated to pay, :func:`~mithril_async.save.xor_choice.delta_pays`), or full.

    Returns the plan and the raw xxh64 of every tensor stored in full (for later dedup).
    Runs on a worker thread: bytewise comparisons and hashes are memory-bound C loops.
    """
    plan = EncodePlan()
    hashes: dict[str, int] = {}
    base: dict[str, Staged] = {}
    if chain.base_idx is not None:
        base = chain.areas[chain.base_idx].buffers
    pol = chain.policy
    params = CodecParams(byte_grouping=pol.byte_grouping)
    keyframe = (not pol.delta or chain.base_blob is None
                or chain.chain_len >= pol.keyframe_interval)
    for name, t in tensors.items():
        b = base.get(name)
        same_layout = b is not None and b.dtype == t.dtype and b.shape == t.shape
        raw = _raw(t)
        if same_layout and b is not None:
            braw = _raw(b)
            if pol.dedup and name in chain.phys and np.array_equal(raw, braw):
                plan.refs[name] = chain.phys[name]
                if name in chain.nonfinite:
                    plan.nonfinite[name] = chain.nonfinite[name]
                continue
            if not keyframe and delta_pays(raw, braw, dtype_name(t), t.element_size(),
                                           params, pol.min_gain):
                plan.base_views[name] = braw
                continue
        if pol.dedup:
            hashes[name] = xxhash.xxh64_intdigest(raw.data)
    if plan.base_views:
        plan.base = chain.base_blob
    return plan, hashes


def depends_on(blobs: Iterable[BlobRef]) -> list[BaseRef]:
    """The blobs of earlier versions that ``blobs`` need to restore: their delta bases and
    the holders of the tensors they only reference (what must still exist at commit)."""
    out: list[BaseRef] = []
    for b in blobs:
        if b.base is not None:
            out.append(b.base)
        out.extend(b.refs)
    return out


def commit_item(chain: ItemChain, written_idx: int, version_id: str, ref: BlobRef,
                plan: EncodePlan, hashes: dict[str, int], names: list[str],
                nonfinite: dict[str, tuple[int, int]] | None = None) -> None:
    """Make the just-committed snapshot the base of the next version (``nonfinite``: the
    NaN/Inf counts of its tensors that hold any).

    Under ``delta_base = "keyframe"`` a version coded against the base (deltas, references)
    leaves the keyframe as the base; only a keyframe replaces it.
    """
    depends = bool(plan.base_views or plan.refs)
    if chain.policy.delta_base == "keyframe" and depends and chain.base_blob is not None:
        chain.chain_len += 1  # versions in this keyframe's group, for keyframe_interval
        return
    holder = BaseRef(version_id=version_id, key=ref.key, xxh64=ref.xxh64)
    phys: dict[str, TensorRef] = {}
    for name in names:
        if name in plan.refs:
            phys[name] = plan.refs[name]
        elif name in hashes:
            phys[name] = TensorRef(holder, name, hashes[name])
    chain.phys = phys
    chain.nonfinite = dict(nonfinite or {})
    chain.chain_len = chain.chain_len + 1 if plan.base_views else 1
    chain.base_blob = holder
    chain.base_idx = written_idx if len(chain.areas) > 1 else None
