"""A staged snapshot and the buffer set that holds it, as the encoder sees them.

:class:`BufferSet` is one item's set of staging buffers by tensor name, reused from save to
save (a delta chain keeps two: the base and the next snapshot); :class:`HostCopies` is what
one save staged into it, with what says the copy is complete. Both hold tensors without touching
them, so the checkpoint worker, whose buffers are views of its trainer's shared staging
memory (:class:`~mithril_async.codec.dtypes.RawTensor`), uses them without torch; the copy
into them is :class:`~mithril_async.save.staging.StagingArea`'s, in the training process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BufferSet", "Job", "HostCopies"]

#: one byte copy: (source address, destination address, bytes)
Job = tuple[int, int, int]


@dataclass
class HostCopies:
    """Host copies of one state's tensors, plus what is needed to know they are complete."""

    #: torch tensors in the trainer, RawTensors in a checkpoint worker
    tensors: dict[str, Any]
    event: Any = None  # torch.cuda.Event when a device copy is in flight
    nbytes: int = 0
    copy_s: float = 0.0
    reused: bool = True
    devices: set[str] = field(default_factory=set)
    #: byte copies left to a background thread (``defer``), not yet run
    deferred: list[Job] = field(default_factory=list)
    #: (name, source, its ``_version`` at snapshot time) for every deferred copy
    watch: list[tuple[str, Any, int]] = field(default_factory=list)
    #: torch.cuda.Event after the deferred device copies (``defer``), with their sources
    later_event: Any = None
    later_watch: list[tuple[str, Any, int]] = field(default_factory=list)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait_blocking(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    async def wait(self, poll_s: float = 0.0002) -> None:
        """Yield to the event loop until the device copies completed."""
        if self.event is not None:  # only a training process with a device has one
            from mithril_async.device import await_event

            await await_event(self.event, poll_s)


class BufferSet:
    """Staging buffers keyed by tensor name: what a snapshot was staged into."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def buffers(self) -> dict[str, Any]:
        """The staged tensors by name (read-only use: they are reused by the next snapshot)."""
        return self._buffers

    def release(self) -> None:
        self._buffers.clear()

    def adopt(self, buffers: dict[str, Any]) -> None:
        """Hold ``buffers`` as this set's (another process's snapshot, mapped here)."""
        self._buffers = dict(buffers)
