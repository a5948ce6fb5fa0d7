"""The streamed snapshot: a save under ``host_memory_mib`` whose staged copy would not fit.

Nothing is staged. :class:`StreamSnapshot` hands the live tensors to the encoder, which copies
them chunk by chunk into a :class:`~mithril_async.memory.ring.SlotRing` of reused buffers
(pinned on CUDA, device-to-host through the device copier with an event per slot), encodes
and writes each chunk, and only then reuses its slot. The caller waits until every chunk it
must not change has been copied out; the blob is byte for byte what the staged path writes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from mithril_async.codec import kernels as K
from mithril_async.codec.dtypes import dtype_name
from mithril_async.device import CudaCopier
from mithril_async.memory.ring import SlotLease, SlotRing
from mithril_async.save.items import StreamedTensor
from mithril_async.save.staging import STREAM_COPY_MIN_BYTES, torn, torn_error

__all__ = ["DeviceCopier", "StreamSnapshot", "StreamedTensor"]


class DeviceCopier(Protocol):
    """What a streamed snapshot needs of its device copier (a
    :class:`~mithril_async.device.CudaCopier`; tests pass CPU stand-ins)."""

    def new_event(self) -> Any: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event: Any) -> None: ...


class StreamSnapshot:
    """One save's snapshot under a budget: the live tensors, copied out by the encoder.

    The codec threads call :meth:`fetch` for each chunk (into a ring slot: a native copy on
    the CPU, a device copy behind the slot's event on CUDA, ordered after the work queued
    when the snapshot was taken). Bytes copied out are counted: ``now_done`` resolves once
    every ``now`` tensor is out (the caller may go on), then ``all_done`` once the ``later``
    ones are (an overlapped step may run); just before, the later tensors' version counters
    are compared, and a change is :class:`~mithril_async.errors.SnapshotTorn`, raised into
    the encoder so the save fails. :meth:`close` resolves both whatever happened (a failed
    save must not leave the caller or a step waiting).
    """

    def __init__(self, ring: SlotRing, on_now: Callable[[], None] | None = None,
                 copier: DeviceCopier | None = None) -> None:
        self.ring = ring
        #: device-to-host copies (a CudaCopier, made at the first device tensor)
        self.copier = copier
        self.tensors: dict[str, dict[str, StreamedTensor]] = {}
        self.now_left = 0
        self.later_left = 0
        self.watch: list[tuple[str, torch.Tensor, int]] = []
        self.now_done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.all_done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.on_now = on_now
        self._lock = threading.Lock()
        self.devices: set[str] = set()

    def add(self, item: str, name: str, src: torch.Tensor, later: bool,
            device: bool | None = None) -> StreamedTensor:
        """Stream ``src`` (``device``: through :attr:`copier`; default: not on the CPU)."""
        device = src.device.type != "cpu" if device is None else device
        t = StreamedTensor(self, f"{item}/{name}", src, later, dtype_name(src, where=name),
                           tuple(int(s) for s in src.shape), device)
        self.tensors.setdefault(item, {})[name] = t
        self.devices.add(src.device.type)
        if later:
            self.later_left += t.nbytes
            self.watch.append((t.name, src, src._version))
        else:
            self.now_left += t.nbytes
        if device and self.copier is None:
            self.copier = CudaCopier(src.device)
        return t

    def start(self) -> None:
        """All tensors added: resolve what is already complete (nothing to copy)."""
        self._progress(0, False)

    def fetch(self, lease: SlotLease, t: StreamedTensor, off: int, n: int
              ) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Copy bytes ``[off, off + n)`` of ``t`` into the slot; return them (a codec thread)."""
        if off < 0 or n < 0 or off + n > t.nbytes or n > lease.ring.slot_bytes:
            raise ValueError(f"{t.name}: chunk [{off}, {off + n}) outside the tensor or slot")
        dst = lease.tensor[:n]
        assert t.src is not None, "a tensor of this process"
        if t.device:  # device-to-host on the side stream, behind the slot's own event
            ring, i = lease.ring, lease.index
            assert self.copier is not None
            if ring.events[i] is None:
                ring.events[i] = self.copier.new_event()
            self.copier.copy(dst, t.src.reshape(-1).view(torch.uint8)[off:off + n],
                             ring.events[i])
        elif K.native_available():
            K.copy_batch([(t.src.data_ptr() + off, dst.data_ptr(), n)], STREAM_COPY_MIN_BYTES)
        else:
            dst.copy_(t.src.reshape(-1).view(torch.uint8)[off:off + n])
        self._progress(n, t.later)
        return lease.array[:n]

    def _progress(self, n: int, later: bool) -> None:
        fire_now = check_later = False
        with self._lock:
            if later:
                self.later_left -= n
            else:
                self.now_left -= n
            if self.now_left == 0 and not self.now_done.done():
                fire_now = True
            if self.now_left == 0 and self.later_left == 0 and not self.all_done.done():
                check_later = True
        if fire_now:
            if self.on_now is not None:
                self.on_now()
            _set(self.now_done)
        if check_later:
            changed = torn(self.watch)
            _set(self.all_done)
            if changed:
                raise torn_error(changed)

    def close(self) -> None:
        _set(self.now_done)
        _set(self.all_done)


def _set(fut: concurrent.futures.Future[None]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        fut.set_result(None)
