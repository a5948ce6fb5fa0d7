"""A ring of reused host buffers of one chunk each.

A streamed save copies each chunk of a live tensor into a slot right before it is encoded,
and gives the slot back once the chunk is encoded; a restore decodes a chunk into a slot and
gives it back once the chunk reached its live tensor. The ring's size is what either holds of
host memory, whatever the state's size. Slots are pinned when the other side is a CUDA device
(:mod:`mithril_async.device`). A checkpoint worker encoding a streamed save holds a ring over
its trainer's slots in shared memory (:meth:`SlotRing.over`): the trainer copies each chunk
into the slot the worker leased, the worker encodes it from there.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["SlotLease", "SlotRing"]


class SlotRing:
    """``slots`` reused host buffers of ``slot_bytes`` each (pinned for device copies).

    :meth:`acquire` hands out a free slot, serving ``now`` requests (tensors the caller waits
    for) before ``later`` ones (an overlapped snapshot's optimizer tensors). Each slot has a
    CUDA event (made on first use) that its device copy records. Acquisitions happen on the
    event loop; a :class:`SlotLease` may be released from any thread.
    """

    def __init__(self, slots: int, slot_bytes: int, pin: bool = False,
                 alloc: Callable[..., torch.Tensor] | None = None) -> None:
        """``alloc(shape, dtype, pinned)``: where the slots are allocated (default
        :func:`~mithril_async.device.host_buffer`; shared memory when a checkpoint worker
        encodes)."""
        import torch

        from mithril_async.device import host_buffer

        alloc = host_buffer if alloc is None else alloc
        self.slot_bytes = slot_bytes
        self.pinned = pin
        self.buffers: list[torch.Tensor] = [alloc(slot_bytes, torch.uint8, pin)
                                            for _ in range(slots)]
        self._init(slot_bytes, [b.numpy() for b in self.buffers])

    @classmethod
    def over(cls, arrays: list[np.ndarray[Any, np.dtype[np.uint8]]], slot_bytes: int
             ) -> SlotRing:
        """A ring over slots another process allocated (views of them; no torch)."""
        ring = cls.__new__(cls)
        ring.buffers, ring.pinned = [], False
        ring._init(slot_bytes, arrays)
        return ring

    def _init(self, slot_bytes: int, arrays: list[np.ndarray[Any, np.dtype[np.uint8]]]
              ) -> None:
        slots = len(arrays)
        self.slot_bytes = slot_bytes
        self.arrays = arrays
        self.events: list[Any] = [None] * slots
        self._free: deque[int] = deque(range(slots))
        self._waiting: tuple[deque[asyncio.Future[int]], deque[asyncio.Future[int]]] = (
            deque(), deque())
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.arrays)

    @property
    def free(self) -> int:
        return len(self._free)

    async def acquire(self, later: bool = False) -> SlotLease:
        with self._lock:
            if self._free and not self._waiting[0] and (later is False
                                                        or not self._waiting[1]):
                return SlotLease(self, self._free.popleft())
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._waiting[int(later)].append(fut)
        try:
            return SlotLease(self, await fut)
        except asyncio.CancelledError:
            with self._lock:
                if fut in self._waiting[int(later)]:
                    self._waiting[int(later)].remove(fut)
                elif fut.done() and not fut.cancelled():  # granted as we were cancelled
                    self.give(fut.result())
            raise

    def give(self, slot: int) -> None:
        """Slot ``slot`` is free: hand it to the first waiter (``now`` ones first)."""
        with self._lock:
            for queue in self._waiting:
                while queue:
                    fut = queue.popleft()
                    if not fut.done():
                        fut.get_loop().call_soon_threadsafe(_grant, fut, slot, self)
                        return
            self._free.append(slot)


def _grant(fut: asyncio.Future[int], slot: int, ring: SlotRing) -> None:
    if fut.done():  # cancelled meanwhile: the slot goes to the next waiter
        ring.give(slot)
    else:
        fut.set_result(slot)


class SlotLease:
    """One acquired slot; :meth:`release` (idempotent, any thread) gives it back."""

    def __init__(self, ring: SlotRing, index: int) -> None:
        self.ring, self.index = ring, index
        self._lock = threading.Lock()
        self._held = True

    @property
    def array(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.ring.arrays[self.index]

    @property
    def tensor(self) -> torch.Tensor:
        return self.ring.buffers[self.index]

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self.ring.give(self.index)
