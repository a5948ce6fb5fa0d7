"""Copies between host memory and a CUDA device, off the training's stream.

One copier serves both directions: device-to-host for a save's snapshot (the staging buffers,
or a streamed snapshot's ring slots) and host-to-device for a restore's staged chunks. Its
copies run on a side stream of their own, ordered after the work already queued on the
producer's stream, so nothing still being computed is read, and nothing still being read is
overwritten. Completion is a CUDA event that only the thread which needs the bytes waits for:
never a device-wide synchronize, so the training's other streams keep running. Host buffers
of device copies are pinned (page-locked): a ``non_blocking`` copy is asynchronous only then.

Nothing here runs without CUDA except :func:`host_buffer` and :func:`await_event`, which
tests drive with stand-in events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["CudaCopier", "await_event", "host_buffer", "order_after", "pinning"]


def pinning() -> bool:
    """Whether host buffers meant for device copies should be pinned (a CUDA device exists)."""
    return torch.cuda.is_available()


def host_buffer(shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype,
                pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pinned`` (for ``non_blocking``
    copies to or from a device)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)


async def await_event(event: Any, poll_s: float = 0.0002) -> None:
    """Yield to the event loop until a (CUDA) event has completed; never blocks the loop."""
    while not event.query():
        await asyncio.sleep(poll_s)


def order_after(event: Any) -> None:
    """Make the current CUDA stream wait for ``event`` (on the device: no CPU wait)."""
    torch.cuda.current_stream().wait_event(event)


class CudaCopier:
    """Copies between pinned host buffers and one device on a side stream.

    Two ways to copy:

    * :meth:`queue` (snapshots into staging buffers): a batch of copies ordered after
      everything queued on the current stream *now*, and one event recorded after them, which
      the caller awaits or hands to whoever must not touch the sources before they are read.
    * :meth:`copy` (a streamed snapshot's chunks, a restore's staged chunks): one copy ordered
      after the current stream's work when the copier was made (``ready``), then its event
      waited for on the calling thread only, so the host buffer may be reused (or read) once
      the call returns. ``event`` lets a caller reuse one event per buffer.

    Tests stand in for it with CPU fakes offering the same calls.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def queue(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)``; return the event after them."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event: Any = None) -> None:
        """Copy ``src`` into ``dst`` on the side stream and wait until it is done."""
        event = self.new_event() if event is None else event
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        event.synchronize()
