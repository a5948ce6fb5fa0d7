"""The host memory a save holds, counted against ``[checkpointing.pipeline] host_memory_mib``.

:class:`HostBudget` is the account: *fixed* holdings that live across saves (staging buffers,
the slot ring, the codec threads' own buffers) and *dynamic* ones a save takes and gives back
(codec scratch and encoded chunks until written, write buffers, blob headers). With a limit,
an acquisition waits until it fits: back-pressure, never a silent overrun; one that can never
fit raises :class:`~mithril_async.errors.HostMemoryExceeded`. Without a limit the account is
only kept, so every save can report its peak.

:class:`EncodeBudget` is the arithmetic of encoding blobs against that account: how many raw
bytes may be in flight between the codec threads and the store, what a blob takes before its
first chunk (its *admission*) and at most, how many codec lanes a streamed save affords. The
blob writers ask it; they do no memory arithmetic of their own. A blob is admitted whole
before it takes budget chunk by chunk, and takes further chunks only from free budget (else
it writes its own finished chunks first), so blobs sharing a budget cannot deadlock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mithril_async.codec.chunk import CodecParams
from mithril_async.config import PipelineConfig
from mithril_async.errors import HostMemoryExceeded

__all__ = ["WRITE_BUFFER_BYTES", "BlobDemand", "ChunkWindow", "EncodeBudget", "HostBudget",
           "mib", "thread_scratch"]

#: what a store's blob writer may buffer (LocalStore coalesces writes up to 1 MiB); an S3
#: store adds its part buffers (:attr:`EncodeBudget.write_buffer_bytes`)
WRITE_BUFFER_BYTES = 1 << 20


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def thread_scratch(chunk_bytes: int) -> int:
    """Host memory one codec thread keeps between chunks (codec/chunk.py's transform
    scratch, the rANS output buffer, a zstd context): about two chunks plus 2 MiB."""
    return 2 * chunk_bytes + (2 << 20)


class HostBudget:
    """The pipeline's own account of the host memory it holds, against a limit.

    *Fixed* holdings are set by name (:meth:`set_fixed`); *dynamic* ones are taken and
    released (:meth:`acquire` / :meth:`take` / :meth:`release`). ``peak`` is the most held
    since :meth:`reset_peak`. Releases may come from any thread; waiters live on one event
    loop.
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
        """Record a long-lived holding (``what``: "staging", "ring", "codec") at ``n`` bytes."""
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


@dataclass(frozen=True)
class BlobDemand:
    """What the budget needs to know of one blob before it is written."""

    #: the codec parameters the blob is written with (its chunk size)
    params: CodecParams
    #: an estimate of its header: the state's non-tensor values and the tensor index
    header_bytes: int
    #: copied out of the live tensors through the slot ring (no staged copy)
    streamed: bool


class EncodeBudget:
    """How much host memory encoding blobs takes from ``host``, and how much of it at once.

    ``threads``: the codec threads encoding; ``chunk_bytes``: the configured chunk size;
    ``compressed``: blobs are MCKP (chunks encoded on the pool), else safetensors written
    straight from the staged bytes."""

    def __init__(self, pipe: PipelineConfig, threads: int, chunk_bytes: int,
                 compressed: bool) -> None:
        self.pipe = pipe
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.compressed = compressed
        self.host = HostBudget(None if pipe.host_memory_mib is None
                               else pipe.host_memory_mib << 20)
        #: what a store's writer may buffer while a blob is written
        self.write_buffer_bytes = WRITE_BUFFER_BYTES

    def codec_scratch(self, threads: int | None = None) -> int:
        """The codec threads' own buffers (``threads`` of them; default: all)."""
        return (self.threads if threads is None else threads) * thread_scratch(self.chunk_bytes)

    def lanes(self, admission: int) -> int:
        """Codec lanes of a streamed save beside one blob's ``admission``: a lane is one
        chunk in flight (its ring slot, two chunks of budget, a codec thread's buffers); as
        many as there are codec threads, if the limit leaves room, and at least one."""
        assert self.host.limit is not None
        lane = 3 * self.chunk_bytes + thread_scratch(self.chunk_bytes)
        return max(1, min(self.threads, (self.host.limit - admission) // lane))

    def inflight_limit(self, params: CodecParams) -> int:
        """Raw bytes of chunks in flight (submitted, not yet written): ``max_inflight_mib``,
        but never more than two chunks per codec thread (at least 4): that keeps the
        encoders busy, and more only piles up encoded chunks waiting for the writer."""
        window = max(4, 2 * self.threads) * params.chunk_bytes
        return min(self.pipe.max_inflight_mib << 20, window)

    def deferred_limit(self, blob: BlobDemand) -> int:
        """Bytes a blob writer holds while its key is still being agreed: one chunk when
        streamed under a budget, else the encode window."""
        return blob.params.chunk_bytes if blob.streamed else self.inflight_limit(blob.params)

    def admission(self, blob: BlobDemand) -> int:
        """What a blob takes before its first chunk, and holds to its end (an estimate
        before the header exists, exact in the writer): write buffers, its first bytes while
        the version is agreed, the header twice (it and the writer's copy), and one chunk in
        flight (two chunks: codec scratch, encoded block), so every admitted blob can always
        make progress, whatever the others hold."""
        floor = 2 * blob.params.chunk_bytes if self.compressed else 0
        return (self.write_buffer_bytes + self.deferred_limit(blob) + 2 * blob.header_bytes
                + floor)

    def write_reserve(self, blob: BlobDemand) -> int:
        """The most a blob's writing takes besides its source tensors: its admission plus
        two chunks per further chunk in flight."""
        extra = 2 * self.inflight_limit(blob.params) if self.compressed else 0
        return self.admission(blob) + extra

    def writer_hold(self, blob: BlobDemand, key_known: bool) -> int:
        """What the store's writer may buffer while the blob is written: its write buffers,
        and while the key is being agreed (``key_known`` False) the bytes waiting for it."""
        return self.write_buffer_bytes + (0 if key_known else self.deferred_limit(blob))

    @staticmethod
    def header_admission(hold: int, header_len: int) -> int:
        """An uncompressed blob's admission: the writer's ``hold`` and its header twice."""
        return hold + 2 * header_len

    def chunked_admission(self, hold: int, header_len: int, chunks: int,
                          params: CodecParams) -> tuple[int, int]:
        """An MCKP blob's admission and, within it, its *floor*: ``hold``, the header and
        its copy in the writer, the index (``chunks`` entries), and under a limit one chunk
        in flight (two chunks: its encoding, its encoded block), so no blob ever waits for
        budget while holding part of it."""
        floor = 2 * params.chunk_bytes if self.host.limit is not None else 0
        return hold + 2 * header_len + 64 * chunks + floor, floor

    def window(self, params: CodecParams, floor: int) -> ChunkWindow:
        """The in-flight account of one blob's chunks (see :class:`ChunkWindow`)."""
        return ChunkWindow(self.host, self.inflight_limit(params), floor)


class ChunkWindow:
    """One blob's chunks in flight: at most ``limit`` raw bytes (one batch always fits), and
    per chunk two chunks of host budget (codec scratch, then its encoded block) until it is
    written, taken from the blob's ``floor`` when free, else from free budget.

    :meth:`take_now` never waits; :meth:`take_waiting` waits for budget, and is for when the
    blob holds nothing else in flight. :meth:`close` gives back what it still holds."""

    def __init__(self, host: HostBudget, limit: int, floor: int) -> None:
        self.host, self.limit = host, limit
        self.used = 0  # raw bytes in flight
        self.held = 0  # budget taken beyond the floor
        self.floor_free = floor

    def fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def take_now(self, n: int) -> bool | None:
        """Budget for a chunk of ``n`` raw bytes: True from the floor, False from free
        budget, None if neither has room now."""
        if self.floor_free >= 2 * n:
            self.floor_free -= 2 * n
            self.used += n
            return True
        if self.host.try_take(2 * n):
            self.held += 2 * n
            self.used += n
            return False
        return None

    async def take_waiting(self, n: int, what: str) -> bool:
        """Budget for a chunk of ``n`` raw bytes, waiting for it (never from the floor)."""
        await self.host.acquire(2 * n, what)
        self.held += 2 * n
        self.used += n
        return False

    def give_back(self, n: int, from_floor: bool) -> None:
        """A chunk of ``n`` raw bytes was written: its budget is free again."""
        self.used -= n
        if from_floor:
            self.floor_free += 2 * n
        else:
            self.host.release(2 * n)
            self.held -= 2 * n

    def close(self) -> None:
        self.host.release(self.held)
        self.held = 0
