"""Bytes between ranks for the tier layer, over its own gloo group, every call bounded.

Why another group: the replication of a save's blobs (hundreds of MB per rank) must never
queue behind or in front of the training collectives, nor the save protocol's small messages
(:class:`~mithril_async.distributed.DistCoordinator`'s group). Why deadlines: a peer that died
must turn into an error naming it within ``timeout_s``, never a hang. Every call here blocks;
the tier layer runs them, one at a time and in the same order on every rank, on its own
worker loop (``asyncio.to_thread``), so the order of operations on the group is the program's.

A message is a length (one int64) followed by the payload (uint8) under the next tag: the
receiver needs no size in advance (an RNG file's size is not in the manifest). All messages
of one step are posted at once (``exchange``), so both directions of a pair overlap and no
order of posting can deadlock. A
:class:`LocalLink` stands in for a single process (nothing to send).
"""

from __future__ import annotations

import contextlib
import mmap
import warnings
from datetime import timedelta
from typing import Any, Protocol, TypeAlias

import torch
import torch.distributed as dist

from mithril_async.errors import DistributedError

#: what can be sent: bytes, or a read-only map of a file (sent from the page cache, no copy)
Payload: TypeAlias = "bytes | memoryview | mmap.mmap"


def _view(data: Payload) -> torch.Tensor:
    """A uint8 tensor over ``data`` without a copy (gloo only reads a send buffer, so the
    read-only warning torch gives for immutable bytes or a read-only map does not apply)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class Link(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any, what: str) -> list[Any]: ...
    def exchange(self, sends: list[tuple[int, int, Payload]], recvs: list[tuple[int, int]],
                 what: str) -> dict[int, bytes | memoryview]: ...
    def close(self) -> None: ...


class LocalLink:
    """One process: gathers return the caller's object; there is no peer to talk to."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj]

    def exchange(self, sends: list[tuple[int, int, Payload]], recvs: list[tuple[int, int]],
                 what: str) -> dict[int, bytes | memoryview]:
        if sends or recvs:
            raise DistributedError(f"rank 0: {what}: no peer rank in a single process")
        return {}

    def close(self) -> None:
        return None


class GlooLink:
    """Point-to-point bytes and small object gathers on a dedicated gloo group.

    Every rank of the default group constructs it at the same point (group creation is a
    collective). After a failed call the group is marked broken: the ranks no longer agree on
    the sequence of messages, so later calls fail fast instead of pairing wrong messages."""

    def __init__(self, timeout_s: float) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError("the tier layer needs torch.distributed initialised on "
                                   "every rank (dist.init_process_group)")
        self.timeout_s = float(timeout_s)
        self._timeout = timedelta(seconds=self.timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=self._timeout)
        self.rank: int = dist.get_rank(self.group)
        self.world_size: int = dist.get_world_size(self.group)
        self._broken: str | None = None

    def _guard(self, what: str) -> None:
        if self._broken is not None:
            raise DistributedError(f"rank {self.rank}: {what}: the tier group is unusable after "
                                   f"an earlier failure ({self._broken})")

    def _fail(self, what: str, err: BaseException) -> DistributedError:
        msg = (f"rank {self.rank}/{self.world_size}: {what} failed within "
               f"{self.timeout_s:g}s ({type(err).__name__}: {str(err).strip()[:300]}); the peer "
               "died, hung or failed before reaching this step")
        self._broken = msg
        return DistributedError(msg)

    def _wait(self, work: Any) -> None:
        if work is not None:
            work.wait(self._timeout)

    def _global(self, rank: int) -> int:
        return int(dist.get_global_rank(self.group, rank))

    def exchange(self, sends: list[tuple[int, int, Payload]], recvs: list[tuple[int, int]],
                 what: str) -> dict[int, bytes | memoryview]:
        """Every ``(dst, tag, data)`` sent and every ``(src, tag)`` received at once, all
        in flight together (both directions of a pair overlap); returns ``{tag: bytes}`` (views
        of the receive buffers: no copy).
        Tags must be unique per pair and agreed by both sides."""
        self._guard(what)
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        try:
            for dst, tag, data in sends:
                n = torch.tensor([len(data)], dtype=torch.int64)
                keep.append(n)
                works.append(dist.isend(n, self._global(dst), group=self.group, tag=2 * tag))
                if data:
                    buf = _view(data)
                    keep.append(buf)
                    works.append(dist.isend(buf, self._global(dst), group=self.group,
                                            tag=2 * tag + 1))
            sizes = {}
            for src, tag in recvs:
                sizes[tag] = (src, torch.zeros(1, dtype=torch.int64))
                works.append(dist.irecv(sizes[tag][1], self._global(src), group=self.group,
                                        tag=2 * tag))
            bufs: dict[int, torch.Tensor] = {}
            pending: list[Any] = []
            for w in works[len(works) - len(recvs):]:
                self._wait(w)
            for tag, (src, n) in sizes.items():
                size = int(n.item())
                bufs[tag] = torch.empty(size, dtype=torch.uint8)
                if size:
                    pending.append(dist.irecv(bufs[tag], self._global(src), group=self.group,
                                              tag=2 * tag + 1))
            for w in pending + works[: len(works) - len(recvs)]:
                self._wait(w)
        except Exception as err:
            peers = sorted({d for d, _, _ in sends} | {s for s, _ in recvs})
            raise self._fail(f"{what} (with rank(s) {peers})", err) from err
        return {tag: b.numpy().data for tag, b in bufs.items()}

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        self._guard(what)
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as err:
            raise self._fail(what, err) from err
        return out

    def close(self) -> None:
        if self._broken is None and dist.is_initialized():
            with contextlib.suppress(Exception):  # the default group may be gone at shutdown
                dist.destroy_process_group(self.group)
