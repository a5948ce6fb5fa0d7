"""What the encoder is handed: one state item's tensors (:class:`StagedItem`) and how to
encode them against the previous version (:class:`EncodePlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mithril_async.codec.dtypes import SizedByName
from mithril_async.manifest import BaseRef
from mithril_async.pipeline.blobs import TensorRef

if TYPE_CHECKING:
    import torch

    from mithril_async.memory.ring import SlotLease, SlotRing

__all__ = ["U8", "ChunkSource", "EncodePlan", "StagedItem", "StreamedTensor"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]


@dataclass
class EncodePlan:
    """How to encode one item: which tensors are deltas against ``base``, which are refs."""

    base: BaseRef | None = None
    base_views: dict[str, U8] = field(default_factory=dict)
    refs: dict[str, TensorRef] = field(default_factory=dict)
    #: (NaNs, Infs) of referenced tensors that hold any: the base's, as they are its bytes
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)


class ChunkSource(Protocol):
    """Where a streamed tensor's chunks are copied out from (a
    :class:`~mithril_async.save.stream_snapshot.StreamSnapshot`): its slot ring, and the
    copy-out."""

    ring: SlotRing

    def fetch(self, lease: SlotLease, t: StreamedTensor, off: int, n: int) -> U8: ...


@dataclass
class StreamedTensor(SizedByName):
    """A live tensor a streamed snapshot copies out chunk by chunk (see StreamSnapshot).

    A streamed item's ``tensors`` are these (their ``dtype`` is the stable name): the
    encoder reads their chunks through :meth:`fetch`, never the tensor itself, which in a
    checkpoint worker is in another process (``src`` is None there)."""

    snap: ChunkSource
    name: str
    src: torch.Tensor | None  # plain and contiguous, on the CPU or a CUDA device
    later: bool  # an overlapped snapshot's optimizer-owned tensor (copied after save())
    dtype: str
    shape: tuple[int, ...]
    device: bool = False  # copied by the snapshot's device copier (CUDA), not on the CPU

    def fetch(self, lease: SlotLease, off: int, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.snap.fetch(lease, self, off, n)


@dataclass
class StagedItem:
    """One stateful object's snapshot: its tree skeleton and its staged tensors."""

    name: str
    skeleton: Any
    #: torch tensors in the trainer; views of its staging memory in a checkpoint worker
    #: (:class:`~mithril_async.codec.dtypes.RawTensor`): the encoder reads either through
    #: :func:`~mithril_async.codec.dtypes.tensor_bytes`
    tensors: dict[str, Any]
    #: which of the item's staging buffer sets holds ``tensors`` (double-buffered chains)
    area_idx: int = 0
    #: streamed under host_memory_mib: ``tensors`` are the live ones, copied out chunk by
    #: chunk through ``ring`` (see StreamSnapshot); None: ``tensors`` are staged copies
    stream: dict[str, StreamedTensor] | None = None
    ring: SlotRing | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
