"""The Stager: the only part of a save that blocks training.

It copies every tensor of the state into host buffers that are allocated once and reused
across saves (same names, dtypes and shapes → same buffers). CPU tensors of 1 MiB and more are
copied by the native streaming copy (non-temporal stores: the reused buffer is not read into
the cache before being overwritten, ~1.7x ``memcpy``'s speed for big states), smaller ones with
``copy_``; CUDA tensors go into pinned buffers with ``non_blocking`` copies on a side stream,
and the snapshot is consistent once that stream's event has completed — ``save()`` awaits the
event, never a device-wide synchronize, so other streams keep running.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mithril_async.codec import kernels as K

#: CPU tensors at least this big are staged with the native streaming copy.
STREAM_COPY_MIN_BYTES = 1 << 20


def _stream_copyable(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes are exactly its values, laid out as ``buf``'s (a plain byte copy
    is then the same as ``buf.copy_(src)``)."""
    return (K.native_available() and type(src) in (torch.Tensor, torch.nn.Parameter)
            and src.device.type == "cpu" and not src.is_quantized
            and src.layout == torch.strided and src.dtype == buf.dtype
            and src.shape == buf.shape and src.is_contiguous() and buf.is_contiguous()
            and not src.is_conj() and not src.is_neg()
            and src.numel() * src.element_size() >= STREAM_COPY_MIN_BYTES)


def copy_into(buf: torch.Tensor, src: torch.Tensor) -> None:
    """``buf.copy_(src)`` for a CPU ``src``; big plain tensors go through the native
    streaming copy (same bytes, fewer memory round trips)."""
    if _stream_copyable(buf, src):
        try:
            s = src.detach().reshape(-1).view(torch.uint8).numpy()
            d = buf.reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError):  # a dtype torch will not view as bytes
            pass
        else:
            K.copy_stream(s, d)
            return
    buf.copy_(src)


@dataclass
class Snapshot:
    """Host copies of one state's tensors, plus what is needed to know they are complete."""

    tensors: dict[str, torch.Tensor]
    event: Any = None  # torch.cuda.Event when a device copy is in flight
    nbytes: int = 0
    copy_s: float = 0.0
    reused: bool = True
    devices: set[str] = field(default_factory=set)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait_blocking(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    async def wait(self, poll_s: float = 0.0002) -> None:
        """Yield to the event loop until the device copies completed."""
        while not self.ready():
            await asyncio.sleep(poll_s)


class StagingArea:
    """Reusable host buffers keyed by tensor name (one area per blob kind)."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: Any = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The staged tensors by name (read-only use: they are reused by the next snapshot)."""
        return self._buffers

    def release(self) -> None:
        self._buffers.clear()

    def _buffer_for(self, name: str, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        buf = self._buffers.get(name)
        if buf is not None and buf.dtype == src.dtype and buf.shape == src.shape:
            return buf, True
        pin = self._pin and src.device.type == "cuda"
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        self._buffers[name] = buf
        return buf, False

    def snapshot(self, tensors: dict[str, torch.Tensor]) -> Snapshot:
        """Copy ``tensors`` into the reused buffers; device copies are asynchronous."""
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        reused = True
        devices: set[str] = set()
        stale = set(self._buffers) - set(tensors)
        for name in stale:
            del self._buffers[name]
        cuda_items: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, src in tensors.items():
            buf, hit = self._buffer_for(name, src)
            reused &= hit
            devices.add(src.device.type)
            if src.device.type == "cuda":
                cuda_items.append((buf, src))
            else:
                copy_into(buf, src)
            out[name] = buf
        event = self._copy_from_cuda(cuda_items) if cuda_items else None
        nbytes = sum(b.numel() * b.element_size() for b in out.values())
        return Snapshot(out, event, nbytes, time.perf_counter() - t0, reused, devices)

    def _copy_from_cuda(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue D2H copies on a side stream after the producer's work; return their event."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for buf, src in items:
                buf.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return event
