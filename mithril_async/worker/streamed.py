"""A streamed save as a checkpoint worker encodes it: each chunk copied out by the trainer.

Under ``host_memory_mib`` a state whose staged copy does not fit is streamed: nothing is
staged, and each chunk of a live tensor is copied into a slot of a small ring right before it
is encoded (:mod:`~mithril_async.save.stream_snapshot`). With a worker the ring lies in the
trainer's shared memory; the worker's encoder leases a slot, asks the trainer to copy the chunk
into it (the ``fetch`` call: only the trainer holds the live tensors, and it counts what was
copied out, so its ``save()`` returns once everything it must not change is out) and encodes
the chunk from the slot. Host memory stays the ring's, in one process or two.

A trainer that goes away mid-stream leaves chunks nobody can copy: the save fails
(:class:`~mithril_async.errors.TrainerExited`) and is aborted like any failed save.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import numpy as np

from mithril_async.errors import TrainerExited
from mithril_async.memory.ring import SlotLease, SlotRing
from mithril_async.save.items import StreamedTensor
from mithril_async.worker.channel import ChannelClosed
from mithril_async.worker.handoff import error_of

__all__ = ["RemoteStream"]

#: ``call(method, args)``: a call to the trainer over the control channel
Call = Callable[[str, dict[str, Any]], concurrent.futures.Future[Any]]


class RemoteStream:
    """The worker's side of one streamed save: the ring over the trainer's slots, the
    tensors by item (what the encoder reads), and :meth:`fetch` (see module doc)."""

    def __init__(self, step: int, ring: SlotRing, call: Call) -> None:
        self.step = step
        self.ring = ring
        self._call = call
        self.tensors: dict[str, dict[str, StreamedTensor]] = {}
        self._names: dict[str, tuple[str, str]] = {}
        #: the trainer waits for its own copy-out; nothing here waits for it
        self.now_done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.now_done.set_result(None)

    def add(self, item: str, name: str, dtype: str, shape: tuple[int, ...], later: bool
            ) -> StreamedTensor:
        t = StreamedTensor(self, f"{item}/{name}", None, later, dtype, shape)
        self.tensors.setdefault(item, {})[name] = t
        self._names[t.name] = (item, name)
        return t

    def fetch(self, lease: SlotLease, t: StreamedTensor, off: int, n: int
              ) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Have the trainer copy bytes ``[off, off + n)`` of ``t`` into the leased slot;
        return them (on a codec thread, which waits for the trainer's answer)."""
        if off < 0 or n < 0 or off + n > t.nbytes or n > self.ring.slot_bytes:
            raise ValueError(f"{t.name}: chunk [{off}, {off + n}) outside the tensor or slot")
        item, name = self._names[t.name]
        try:
            answer = self._call("fetch", {"step": self.step, "item": item, "tensor": name,
                                          "slot": lease.index, "offset": off, "n": n}).result()
        except ChannelClosed as err:
            raise TrainerExited(
                f"the training process went away while step {self.step} was being streamed "
                "(host_memory_mib): its chunks cannot be copied out; the save is "
                "abandoned") from err
        if answer.get("error") is not None:
            raise error_of(answer["error"])
        return lease.array[:n]

    def close(self) -> None:
        """Nothing to release: the slots are the trainer's."""
