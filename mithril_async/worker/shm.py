"""Staging buffers in shared memory that a checkpoint worker reads without a copy.

The training process allocates its staging buffers from a
:class:`~mithril_async.worker.arena.SharedArena`: anonymous
shared-memory segments (``memfd_create``: no name in any file system) cut into buffers. The
worker receives each segment's file descriptor once over the control channel and maps it
(:class:`SegmentMap`); a staged tensor then travels as ``(segment, offset, dtype, shape)``
and the worker's view of it is the very memory the snapshot wrote. Since the segments have
no names, nothing is left behind when either process dies, however it dies: the memory goes
back to the system once the last mapping and descriptor are gone. Where a CUDA device
exists the segments are page-locked (``cudaHostRegister``), so device-to-host snapshot
copies into them are asynchronous, as into pinned buffers.

Segments grow with what the arena holds (an eighth of it, up to 16 times the first ones' size),
so a state of 100 GiB takes about 130 segments, not 1600: the trainer holds two descriptors
per segment (its own and its mapping's), the worker one (its mapping's), far under the usual
soft limit of 1024 open files; those a save sends travel in messages of at most the channel's
per-message limit.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import numpy as np

from mithril_async.codec.dtypes import RawTensor, dtype_info

__all__ = ["ALIGN", "GROWTH", "MAX_GROWTH", "PAGE", "SEGMENT_BYTES", "BufferAt", "SegmentMap",
           "round_up"]

#: the size of the first segments (a larger buffer gets a segment of its own size)
SEGMENT_BYTES = 64 << 20
#: segments grow to at most this many times the first ones' size (1 GiB by default; a larger
#: buffer still gets its own size): the space a segment leaves unused (page-locked where a CUDA
#: device exists) stays under that
MAX_GROWTH = 16
#: a new segment is at least this fraction of what the arena holds (the count of segments grows
#: as the logarithm of the state's size until they reach their largest size)
GROWTH = 8
ALIGN = 64
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class BufferAt:
    """Where a buffer lies: its segment and the byte offset in it."""

    segment: int
    offset: int


class SegmentMap:
    """The worker's side: the segments it was sent, mapped, and views into them."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}

    def add(self, segments: list[tuple[int, int]], fds: list[int]) -> None:
        """Map ``(segment, size)`` each with its descriptor (closed once mapped)."""
        if len(segments) != len(fds):
            for fd in fds:
                os.close(fd)
            raise ValueError(f"{len(segments)} segments described, {len(fds)} descriptors "
                             "received")
        for (ident, size), fd in zip(segments, fds, strict=True):
            try:
                if os.fstat(fd).st_size < size:
                    raise ValueError(f"segment {ident} is smaller than the {size} bytes "
                                     "announced")
                self._maps[int(ident)] = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                   mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)

    def view(self, at: BufferAt | None, dtype: str, shape: tuple[int, ...]) -> RawTensor:
        """The tensor the trainer staged at ``at`` (None: an empty tensor), as bytes."""
        nbytes = math.prod(shape) * dtype_info(dtype).itemsize
        if nbytes == 0 or at is None:
            return RawTensor(np.empty(0, np.uint8), dtype, shape)
        mm = self._maps.get(at.segment)
        if mm is None:
            raise ValueError(f"segment {at.segment} was never sent")
        if at.offset < 0 or at.offset + nbytes > len(mm):
            raise ValueError(f"a buffer of {nbytes} bytes at {at.offset} does not fit "
                             f"segment {at.segment} ({len(mm)} bytes)")
        return RawTensor(np.frombuffer(mm, np.uint8, nbytes, at.offset), dtype, shape)


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
