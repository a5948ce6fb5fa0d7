"""The trainer's side of the shared staging memory: buffers cut from ``memfd`` segments.

See :mod:`mithril_async.worker.shm` for how the segments are shared and grow; this module
allocates torch tensors in them (the worker's side, which maps them, needs no torch).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from mithril_async.worker.shm import (
    ALIGN,
    GROWTH,
    MAX_GROWTH,
    PAGE,
    SEGMENT_BYTES,
    BufferAt,
    round_up,
)

__all__ = ["SharedArena"]


@dataclass
class _Segment:
    ident: int
    fd: int
    size: int
    mm: mmap.mmap
    used: int = 0
    live: int = 0
    pinned: bool = False
    sent: set[int] = field(default_factory=set)  # the channels (by id) that have it


class SharedArena:
    """Host buffers in shared-memory segments (see the module docstring).

    :meth:`buffer` has the signature of :func:`mithril_async.device.host_buffer`, so a
    staging area allocates from it unchanged. Freed buffers return their space when every
    buffer of their segment is gone (buffers are reused across saves, so this is rare).
    """

    def __init__(self, segment_bytes: int = SEGMENT_BYTES, name: str = "mithril",
                 max_segment_bytes: int | None = None) -> None:
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self.segment_bytes = segment_bytes
        #: never below ``segment_bytes`` (equal: every segment has that size)
        self.max_segment_bytes = max(segment_bytes, MAX_GROWTH * segment_bytes
                                     if max_segment_bytes is None else max_segment_bytes)
        self.name = name
        self._segments: dict[int, _Segment] = {}
        self._where: dict[int, BufferAt] = {}  # buffer data_ptr -> place
        self._next = 1
        self._lock = threading.Lock()
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory held (whole segments)."""
        with self._lock:
            return sum(s.size for s in self._segments.values())

    def buffer(self, shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype,
               pinned: bool = False) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` in shared memory."""
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype)
        with self._lock:
            seg = self._room(nbytes)
            off = seg.used
            seg.used = round_up(off + nbytes, ALIGN)
            seg.live += 1
            if pinned and not seg.pinned:
                _pin(seg)
        t = _view(seg.mm, off, nbytes, dtype, dims)
        with self._lock:
            self._where[t.data_ptr()] = BufferAt(seg.ident, off)
        weakref.finalize(t, self._freed, seg.ident, t.data_ptr())
        return t

    def _room(self, nbytes: int) -> _Segment:
        for seg in self._segments.values():
            if seg.size - seg.used >= nbytes:
                return seg
        held = sum(s.size for s in self._segments.values())
        grown = min(max(self.segment_bytes, held // GROWTH), self.max_segment_bytes)
        size = round_up(max(grown, nbytes), PAGE)
        fd = os.memfd_create(f"{self.name}-{self._next}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        seg = self._segments[self._next] = _Segment(self._next, fd, size, mm)
        self._next += 1
        return seg

    def _freed(self, ident: int, ptr: int) -> None:
        with self._lock:
            self._where.pop(ptr, None)
            seg = self._segments.get(ident)
            if seg is None:
                return
            seg.live -= 1
            if seg.live == 0:
                seg.used = 0  # every buffer of it is gone: its space is free again

    def locate(self, t: torch.Tensor) -> BufferAt | None:
        """Where buffer ``t`` lies, or None when it is not one of this arena's (an empty
        tensor, or memory of its own)."""
        with self._lock:
            return self._where.get(t.data_ptr())

    def unsent(self, channel_id: int) -> list[tuple[int, int, int]]:
        """``(segment, fd, size)`` of the segments a channel has not received yet (the
        caller sends them before the message that first needs them, then
        :meth:`mark_sent`)."""
        with self._lock:
            return [(s.ident, s.fd, s.size) for s in self._segments.values()
                    if channel_id not in s.sent]

    def mark_sent(self, channel_id: int, segments: list[int]) -> None:
        """Record that a channel's peer has mapped ``segments`` (it acknowledged them: one
        it failed to map is sent again with the next save)."""
        with self._lock:
            for ident in segments:
                seg = self._segments.get(ident)
                if seg is not None:
                    seg.sent.add(channel_id)

    def mark_unsent(self, channel_id: int, segments: list[int]) -> None:
        """Undo :meth:`mark_sent`: the peer could not map ``segments`` (sent again next
        time)."""
        with self._lock:
            for ident in segments:
                seg = self._segments.get(ident)
                if seg is not None:
                    seg.sent.discard(channel_id)

    def close(self) -> None:
        """Release the descriptors (mappings go once no tensor uses them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for seg in self._segments.values():
                os.close(seg.fd)


def _view(mm: mmap.mmap, off: int, nbytes: int, dtype: torch.dtype,
          dims: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
    return raw.view(dtype).reshape(dims)


def _pin(seg: _Segment) -> None:
    """Page-lock a segment for asynchronous device copies (a CUDA device exists)."""
    if not torch.cuda.is_available():
        return
    ptr = torch.frombuffer(seg.mm, dtype=torch.uint8, count=1).data_ptr()
    rc: Any = torch.cuda.cudart().cudaHostRegister(ptr, seg.size, 0)
    seg.pinned = int(rc) == 0
