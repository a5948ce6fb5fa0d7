"""The Stager: the only part of a save that blocks training.

It copies every tensor of the state into host buffers that are allocated once and reused
across saves (same names, dtypes and shapes → same buffers). Plain CPU tensors are copied by
one native call for the whole state (:func:`~mithril_async.codec.kernels.copy_batch`, split
over two threads for big states): those of 64 KiB and more with non-temporal stores (the
reused buffer is not read into the cache before being overwritten, ~1.7x ``memcpy``'s speed
for big states), smaller ones with ``memcpy``, and no Python work per tensor beyond collecting
its address (a ``copy_`` per small tensor cost ~40 us: half the stall of a 104-tensor 42 MB
state). Anything else (views with strides, conjugate/negative bits, tensor subclasses) goes
through ``copy_``. CUDA tensors go into pinned buffers with ``non_blocking`` copies on a side
stream, and the snapshot is consistent once that stream's event has completed — ``save()``
awaits the event, never a device-wide synchronize, so other streams keep running.

With ``defer`` (``snapshot = "overlapped"``, :mod:`~mithril_async.pipeline.overlap`), the byte
copies of the named CPU tensors are not run here but returned as jobs, together with each
source's version counter, for a background copy that overlaps the next forward/backward. Named
CUDA tensors are copied on the side stream after the others, behind an event of their own
(``later_event``), which the optimizer's stream waits for before it steps.

Under ``[checkpointing.pipeline] host_memory_mib`` (:class:`HostBudget`, the pipeline's own
account of the host memory it holds) a state whose staged copy would not fit is not staged:
:class:`StreamSnapshot` hands the live tensors to the encoder, which copies them chunk by chunk
into a :class:`SlotRing` of reused buffers (pinned on CUDA, device-to-host on a side stream
with an event per slot), encodes and writes each chunk, and only then reuses its slot. The
caller waits until every chunk it must not change has been copied out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mithril_async.codec import kernels as K
from mithril_async.errors import HostMemoryExceeded, SnapshotTorn

#: CPU tensors at least this big are staged with non-temporal stores (smaller: memcpy).  The
#: staging buffers of a whole state rarely fit the cache, so streaming pays from 64 KiB on
#: (measured on a small model's state: faster than a 1 MiB threshold).
STREAM_COPY_MIN_BYTES = 1 << 16
#: Snapshots of at least this many bytes are copied by two threads (the caller and one
#: helper): one thread does not saturate memory bandwidth, two come closer.
PARALLEL_COPY_MIN_BYTES = 8 << 20

Job = tuple[int, int, int]  # (src address, dst address, nbytes)
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


PLAIN_TYPES = _PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _byte_copyable(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes are exactly its values, laid out as ``buf``'s (a plain byte copy
    is then the same as ``buf.copy_(src)``)."""
    return (type(src) in _PLAIN_TYPES and src.is_cpu and not src.is_quantized
            and src.layout == torch.strided and src.dtype == buf.dtype
            and src.shape == buf.shape and src.is_contiguous() and buf.is_contiguous()
            and not src.is_conj() and not src.is_neg())


@dataclass
class Snapshot:
    """Host copies of one state's tensors, plus what is needed to know they are complete."""

    tensors: dict[str, torch.Tensor]
    event: Any = None  # torch.cuda.Event when a device copy is in flight
    nbytes: int = 0
    copy_s: float = 0.0
    reused: bool = True
    devices: set[str] = field(default_factory=set)
    #: byte copies left to a background thread (``defer``), not yet run
    deferred: list[Job] = field(default_factory=list)
    #: (name, source, its ``_version`` at snapshot time) for every deferred copy
    watch: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    #: torch.cuda.Event after the deferred device copies (``defer``), with their sources
    later_event: Any = None
    later_watch: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait_blocking(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    async def wait(self, poll_s: float = 0.0002) -> None:
        """Yield to the event loop until the device copies completed."""
        if self.event is not None:
            await await_event(self.event, poll_s)


async def await_event(event: Any, poll_s: float = 0.0002) -> None:
    """Yield to the event loop until a (CUDA) event has completed; never blocks the loop."""
    while not event.query():
        await asyncio.sleep(poll_s)


class StagingArea:
    """Reusable host buffers keyed by tensor name (one area per blob kind)."""

    def __init__(self, pin_memory: bool | None = None, copy_threads: int | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.copy_threads = default_copy_threads() if copy_threads is None else copy_threads
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

    def snapshot(self, tensors: dict[str, torch.Tensor],
                 defer: frozenset[int] | set[int] = frozenset()) -> Snapshot:
        """Copy ``tensors`` into the reused buffers; device copies are asynchronous.

        Plain CPU tensors whose ``data_ptr()`` is in ``defer`` are not copied: their jobs and
        version counters come back in ``Snapshot.deferred`` / ``Snapshot.watch``. Plain CUDA
        ones are copied after the others, behind ``Snapshot.later_event`` (``later_watch``).
        """
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        reused = True
        devices: set[str] = set()
        stale = set(self._buffers) - set(tensors)
        for name in stale:
            del self._buffers[name]
        cuda_items: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        later_watch: list[tuple[str, torch.Tensor, int]] = []
        jobs: list[Job] = []  # byte copies, run by native code at the end
        deferred: list[Job] = []
        watch: list[tuple[str, torch.Tensor, int]] = []
        native = K.native_available()
        for name, src in tensors.items():
            buf, hit = self._buffer_for(name, src)
            reused &= hit
            if src.is_cpu:
                devices.add("cpu")
                if native and _byte_copyable(buf, src):
                    n = src.numel() * src.element_size()
                    ptr = src.data_ptr()
                    if n and ptr in defer:
                        deferred.append((ptr, buf.data_ptr(), n))
                        watch.append((name, src, src._version))
                    elif n:
                        jobs.append((ptr, buf.data_ptr(), n))
                else:
                    buf.copy_(src)
            else:
                devices.add(src.device.type)
                if src.device.type == "cuda" and type(src) in _PLAIN_TYPES \
                        and src.numel() and src.data_ptr() in defer:
                    cuda_later.append((buf, src))
                    later_watch.append((name, src, src._version))
                elif src.device.type == "cuda":
                    cuda_items.append((buf, src))
                else:
                    buf.copy_(src)
            out[name] = buf
        copy_jobs(jobs, self.copy_threads)
        event = self._copy_from_cuda(cuda_items) if cuda_items else None
        later = self._copy_from_cuda(cuda_later) if cuda_later else None
        nbytes = sum(b.numel() * b.element_size() for b in out.values())
        return Snapshot(out, event, nbytes, time.perf_counter() - t0, reused, devices,
                        deferred, watch, later, later_watch)

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


# ---------------------------------------------------------------- the host-memory budget

def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class HostBudget:
    """The pipeline's own account of the host memory it holds, against ``host_memory_mib``.

    *Fixed* holdings live across saves (staging buffers, the slot ring: :meth:`set_fixed`);
    *dynamic* ones are taken and released by a save (codec scratch and encoded chunks until
    written, write buffers: :meth:`acquire` / :meth:`release`). With a limit, an
    acquisition waits until it fits (back-pressure, never a silent overrun), and one that can
    never fit raises :class:`HostMemoryExceeded`. ``peak`` is the most held since
    :meth:`reset_peak` (each save reports it). Without a limit nothing waits: the account is
    only kept. Releases may come from any thread; waiters live on one event loop.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._fixed: dict[str, int] = {}
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def fixed(self) -> int:
        return sum(self._fixed.values())

    def _add(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def set_fixed(self, what: str, n: int) -> None:
        """Record a long-lived holding (``what``: "staging", "ring") at ``n`` bytes."""
        with self._lock:
            self._add(n - self._fixed.get(what, 0))
            self._fixed[what] = n
        self._wake()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.held

    def try_take(self, n: int) -> bool:
        with self._lock:
            if self.limit is not None and self.held + n > self.limit and n > 0:
                return False
            self._add(n)
            return True

    def take(self, n: int, what: str) -> None:
        """Take ``n`` bytes now or raise :class:`HostMemoryExceeded` naming ``what``."""
        if not self.try_take(n):
            raise HostMemoryExceeded(
                f"{what} needs {mib(n)} of host memory at once; host_memory_mib = "
                f"{mib(self.limit or 0)} leaves {mib((self.limit or 0) - self.held)}")

    async def acquire(self, n: int, what: str,
                      drain: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Take ``n`` bytes, waiting for releases; ``drain`` (if given) is awaited first to
        free what the caller itself holds (it returns False once it has nothing to free)."""
        if self.limit is not None and n > self.limit - self.fixed:
            raise HostMemoryExceeded(
                f"{what} needs {mib(n)} of host memory at once; host_memory_mib = "
                f"{mib(self.limit)}, of which {mib(self.fixed)} are staging buffers")
        while not self.try_take(n):
            if drain is not None and await drain():
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            with self._lock:
                self._waiters.append(fut)
            if self.try_take(n):  # a release between the check and the registration
                fut.cancel()
                return
            await fut

    def release(self, n: int) -> None:
        if n:
            with self._lock:
                self.held -= n
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(_resolve, fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class SlotRing:
    """``slots`` reused host buffers of ``slot_bytes`` each (pinned for device copies).

    :meth:`acquire` hands out a free slot, serving ``now`` requests (tensors the caller waits
    for) before ``later`` ones (an overlapped snapshot's optimizer tensors). Each slot has a
    CUDA event (made on first use) that its device-to-host copy records. Acquisitions happen
    on the event loop; a :class:`SlotLease` may be released from any thread.
    """

    def __init__(self, slots: int, slot_bytes: int, pin: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.pinned = pin
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin)
                        for _ in range(slots)]
        self.arrays = [b.numpy() for b in self.buffers]
        self.events: list[Any] = [None] * slots
        self._free: deque[int] = deque(range(slots))
        self._waiting: tuple[deque[asyncio.Future[int]], deque[asyncio.Future[int]]] = (
            deque(), deque())
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.buffers)

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
                    self._give(fut.result())
            raise

    def _give(self, slot: int) -> None:
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
        ring._give(slot)
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
            self.ring._give(self.index)


@dataclass
class StreamedTensor:
    """A live tensor a streamed snapshot copies out chunk by chunk (see StreamSnapshot)."""

    snap: StreamSnapshot
    name: str
    src: torch.Tensor  # plain and contiguous, on the CPU or a CUDA device
    later: bool  # an overlapped snapshot's optimizer-owned tensor (copied after save())
    dtype: str
    shape: tuple[int, ...]
    device: bool = False  # copied by the snapshot's device copier (CUDA), not on the CPU

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()

    def fetch(self, lease: SlotLease, off: int, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.snap.fetch(lease, self, off, n)


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


class CudaCopier:
    """The device-to-host copies of one streamed snapshot: on a side stream ordered after the
    work queued on the current stream when the snapshot was taken (``ready``), each behind
    its ring slot's own event, which the codec thread then waits for (that thread only: the
    GIL is released, no device-wide synchronize). Tests stand in for it with CPU fakes."""

    def __init__(self, device: torch.device) -> None:
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.stream = torch.cuda.Stream(device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event: Any) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        event.synchronize()


class StreamSnapshot:
    """One save's snapshot under a budget: the live tensors, copied out by the encoder.

    The codec threads call :meth:`fetch` for each chunk (into a ring slot: a native copy on
    the CPU, a ``non_blocking`` copy on a side stream plus the slot's event on CUDA, ordered
    after the work queued when the snapshot was taken). Bytes copied out are counted:
    ``now_done`` resolves once every ``now`` tensor is out (the caller may go on), then
    ``all_done`` once the ``later`` ones are (an overlapped step may run); just before, the
    later tensors' version counters are compared, and a change is :class:`SnapshotTorn`,
    raised into the encoder so the save fails. :meth:`close` resolves both whatever happened
    (a failed save must not leave the caller or a step waiting).
    """

    def __init__(self, ring: SlotRing, on_now: Callable[[], None] | None = None,
                 copier: Any = None) -> None:
        self.ring = ring
        #: device-to-host copies (a :class:`CudaCopier`, made at the first device tensor)
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
        from mithril_async.codec.dtypes import dtype_name

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
