"""What the encoder is handed: one state item's tensors (:class:`StagedItem`) and how to
encode them against the previous version (:class:`EncodePlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mithril_async.manifest import BaseRef
from mithril_async.memory.ring import SlotRing
from mithril_async.pipeline.blobs import TensorRef
from mithril_async.save.stream import StreamedTensor

__all__ = ["U8", "EncodePlan", "StagedItem"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]


@dataclass
class EncodePlan:
    """How to encode one item: which tensors are deltas against ``base``, which are refs."""

    base: BaseRef | None = None
    base_views: dict[str, U8] = field(default_factory=dict)
    refs: dict[str, TensorRef] = field(default_factory=dict)
    #: (NaNs, Infs) of referenced tensors that hold any: the base's, as they are its bytes
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class StagedItem:
    """One stateful object's snapshot: its tree skeleton and its staged tensors."""

    name: str
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    #: which of the item's staging buffer sets holds ``tensors`` (double-buffered chains)
    area_idx: int = 0
    #: streamed under host_memory_mib: ``tensors`` are the live ones, copied out chunk by
    #: chunk through ``ring`` (see StreamSnapshot); None: ``tensors`` are staged copies
    stream: dict[str, StreamedTensor] | None = None
    ring: SlotRing | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
