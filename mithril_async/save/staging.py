"""The staging copy: the only part of a save that blocks training.

:class:`StagingArea` copies every tensor of the state into host buffers that are allocated once
and reused across saves (same names, dtypes and shapes: same buffers). Plain CPU tensors are
copied by one native call for the whole state (:func:`~mithril_async.codec.kernels.copy_batch`,
split over two threads for big states): those of :data:`STREAM_COPY_MIN_BYTES` and more with
non-temporal stores (the reused buffer is not read into the cache before being overwritten),
smaller ones with ``memcpy``, and no Python work per tensor beyond collecting its address.
Anything else (views with strides, conjugate/negative bits, tensor subclasses) goes through
``copy_``. CUDA tensors go into pinned buffers through the device copier
(:class:`~mithril_async.device.CudaCopier`), and the snapshot is consistent once its event has
completed: ``save()`` awaits that event, never a device-wide synchronize.

With ``defer`` (``snapshot = "overlapped"``, :mod:`~mithril_async.save.overlap`), the byte
copies of the named CPU tensors are not run here but returned as jobs, together with each
source's version counter, for a background copy that overlaps the next forward/backward. Named
CUDA tensors are copied after the others, behind an event of their own (``later_event``),
which the optimizer's stream waits for before it steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from mithril_async.codec import kernels as K
from mithril_async.device import CudaCopier, host_buffer, pinning
from mithril_async.errors import SnapshotTorn
from mithril_async.save.buffers import BufferSet, HostCopies, Job

__all__ = ["PLAIN_TYPES", "STREAM_COPY_MIN_BYTES", "Allocator", "Job", "HostCopies",
           "StagingArea", "copy_jobs", "default_copy_threads", "split_jobs", "torn", "torn_error"]

#: CPU tensors at least this big are staged with non-temporal stores (smaller: memcpy): the
#: staging buffers of a whole state rarely fit the cache, so streaming stores pay early
STREAM_COPY_MIN_BYTES = 1 << 16
#: Snapshots of at least this many bytes are copied by two threads (the caller and one
#: helper): one thread does not saturate memory bandwidth, two come closer.
PARALLEL_COPY_MIN_BYTES = 8 << 20
#: tensor types whose bytes are their values (subclasses may override what a copy means)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

_helper: ThreadPoolExecutor | None = None


def default_copy_threads() -> int:
    """Threads a snapshot copy may use: 2 when this process has two cores to itself.

    Ranks launched on one host share its cores, so each copies on one thread when there are
    fewer than two cores per rank: ``LOCAL_WORLD_SIZE`` (set by torchrun) says how many share
    it; without it, an initialised process group's world size is assumed (the cautious guess).
    """
    try:
        local = max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        dist = torch.distributed
        local = (dist.get_world_size() if dist.is_available() and dist.is_initialized()
                 else 1)
    return 2 if (os.cpu_count() or 1) // local >= 2 else 1


def split_jobs(jobs: list[Job]) -> tuple[list[Job], list[Job]]:
    """Two job lists of (nearly) equal bytes; a job straddling the middle is cut in two."""
    half = sum(n for _, _, n in jobs) // 2
    first: list[Job] = []
    second: list[Job] = []
    acc = 0
    for s, d, n in jobs:
        if acc >= half:
            second.append((s, d, n))
        elif acc + n <= half:
            first.append((s, d, n))
            acc += n
        else:
            k = half - acc
            first.append((s, d, k))
            second.append((s + k, d + k, n - k))
            acc = half
    return first, second


def copy_jobs(jobs: list[Job], threads: int) -> None:
    """Run the snapshot's byte copies: one native call, or two halves on two threads."""
    global _helper
    if threads < 2 or sum(n for _, _, n in jobs) < PARALLEL_COPY_MIN_BYTES:
        K.copy_batch(jobs, STREAM_COPY_MIN_BYTES)
        return
    first, second = split_jobs(jobs)
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="mithril-stage")
    fut = _helper.submit(K.copy_batch, second, STREAM_COPY_MIN_BYTES)
    try:
        K.copy_batch(first, STREAM_COPY_MIN_BYTES)
    finally:
        fut.result()


def _byte_copyable(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes are exactly its values, laid out as ``buf``'s (a plain byte copy
    is then the same as ``buf.copy_(src)``)."""
    return (type(src) in PLAIN_TYPES and src.is_cpu and not src.is_quantized
            and src.layout == torch.strided and src.dtype == buf.dtype
            and src.shape == buf.shape and src.is_contiguous() and buf.is_contiguous()
            and not src.is_conj() and not src.is_neg())


def torn(watch: list[tuple[str, torch.Tensor, int]]) -> list[str]:
    """Names of the watched sources whose version counter moved since it was read."""
    return [name for name, src, version in watch if src._version != version]


def torn_error(changed: list[str]) -> SnapshotTorn:
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more"
                                       if len(changed) > 5 else "")
    return SnapshotTorn(
        f"{len(changed)} tensor(s) changed in place while their overlapped snapshot "
        f"was being copied: {shown}; with snapshot = \"overlapped\" only a hooked "
        "optimizer.step() may change the state between save() and the copy's end "
        "(use snapshot = \"blocking\" otherwise)")


@dataclass
class _Plan:
    """What one snapshot copies, and how: collected first, run at the end."""

    jobs: list[Job] = field(default_factory=list)  # byte copies, one native call
    deferred: list[Job] = field(default_factory=list)
    watch: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    cuda: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    cuda_later: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    later_watch: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    devices: set[str] = field(default_factory=set)


#: ``alloc(shape, dtype, pinned)``: an uninitialised host tensor for a staging buffer
#: (:func:`~mithril_async.device.host_buffer`, or shared memory for a checkpoint worker)
Allocator = Callable[[torch.Size, torch.dtype, bool], torch.Tensor]


class StagingArea(BufferSet):
    """Reusable host buffers keyed by tensor name (one area per blob kind), allocated by
    ``alloc``, and the copy of a live state into them."""

    def __init__(self, pin_memory: bool | None = None, copy_threads: int | None = None,
                 alloc: Allocator = host_buffer) -> None:
        super().__init__()
        self._pin = pinning() if pin_memory is None else pin_memory
        self.copy_threads = default_copy_threads() if copy_threads is None else copy_threads
        self._alloc = alloc
        self._copier: CudaCopier | None = None

    def _buffer_for(self, name: str, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        buf = self._buffers.get(name)
        if buf is not None and buf.dtype == src.dtype and buf.shape == src.shape:
            return buf, True
        buf = self._alloc(src.shape, src.dtype, self._pin and src.device.type == "cuda")
        self._buffers[name] = buf
        return buf, False

    def snapshot(self, tensors: dict[str, torch.Tensor],
                 defer: frozenset[int] | set[int] = frozenset()) -> HostCopies:
        """Copy ``tensors`` into the reused buffers; device copies are asynchronous.

        Plain CPU tensors whose ``data_ptr()`` is in ``defer`` are not copied: their jobs and
        version counters come back in ``HostCopies.deferred`` / ``HostCopies.watch``. Plain CUDA
        ones are copied after the others, behind ``HostCopies.later_event`` (``later_watch``).
        """
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        reused = True
        for name in set(self._buffers) - set(tensors):
            del self._buffers[name]
        plan = _Plan()
        native = K.native_available()
        for name, src in tensors.items():
            buf, hit = self._buffer_for(name, src)
            reused &= hit
            self._plan_copy(plan, name, buf, src, defer, native)
            out[name] = buf
        copy_jobs(plan.jobs, self.copy_threads)
        event = self._copy_from_cuda(plan.cuda) if plan.cuda else None
        later = self._copy_from_cuda(plan.cuda_later) if plan.cuda_later else None
        nbytes = sum(b.numel() * b.element_size() for b in out.values())
        return HostCopies(out, event, nbytes, time.perf_counter() - t0, reused, plan.devices,
                          plan.deferred, plan.watch, later, plan.later_watch)

    @staticmethod
    def _plan_copy(plan: _Plan, name: str, buf: torch.Tensor, src: torch.Tensor,
                   defer: frozenset[int] | set[int], native: bool) -> None:
        """Add the copy of ``src`` into ``buf`` to ``plan``, or run it now (``copy_``)."""
        if src.is_cpu:
            plan.devices.add("cpu")
            if native and _byte_copyable(buf, src):
                n = src.numel() * src.element_size()
                ptr = src.data_ptr()
                if n and ptr in defer:
                    plan.deferred.append((ptr, buf.data_ptr(), n))
                    plan.watch.append((name, src, src._version))
                elif n:
                    plan.jobs.append((ptr, buf.data_ptr(), n))
            else:
                buf.copy_(src)
            return
        plan.devices.add(src.device.type)
        if src.device.type == "cuda" and type(src) in PLAIN_TYPES \
                and src.numel() and src.data_ptr() in defer:
            plan.cuda_later.append((buf, src))
            plan.later_watch.append((name, src, src._version))
        elif src.device.type == "cuda":
            plan.cuda.append((buf, src))
        else:
            buf.copy_(src)

    def _copy_from_cuda(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue device-to-host copies after the producer's work; return their event."""
        if self._copier is None:
            self._copier = CudaCopier()
        return self._copier.queue(items)
