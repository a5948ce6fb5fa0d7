"""The save protocol of :mod:`mithril_async.save.coordinator` over ``torch.distributed``.

Why a separate group: checkpoint traffic (version numbers, blob reports, the commit verdict)
must never queue behind — or in front of — the training collectives, which may run on NCCL and
on other streams. :class:`DistCoordinator` therefore creates its own gloo group
(``dist.new_group(backend="gloo", timeout=...)``) and only sends small pickled objects on it.

Why threads: the object collectives block. The manager runs the protocol on its background
event loop, so each collective runs on a short-lived *daemon* thread and is awaited; the loop
keeps driving the other ranks' work (encoding, writes) meanwhile, and a collective stuck on a
dead peer can never keep the process from exiting.

Why timeouts everywhere: a rank that dies or hangs must not hang the others. Gloo enforces the
group timeout on every operation; on top of it every await is bounded (timeout + grace). Any
failure becomes :class:`~mithril_async.errors.DistributedError` naming the step of the protocol
and the rank, and marks the group broken: after a failed collective the ranks no longer agree on
the sequence of operations, so later calls fail fast instead of pairing up wrong messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from mithril_async.errors import DistributedError
from mithril_async.manifest import PieceLayout, gc_paused
from mithril_async.save.coordinator import (
    Outcome,
    RankPart,
    compact_part,
    layout_senders,
    with_layouts,
)

log = logging.getLogger("mithril_async")

T = TypeVar("T")

#: seconds added to the gloo timeout before an await gives up on its thread
_GRACE_S = 5.0


def dist_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when torch.distributed is initialised, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


class DistCoordinator:
    """Coordinator for ``torch.distributed`` jobs (any training backend; gloo for our traffic).

    Every rank of the default group must construct it at the same point of the program (group
    creation is itself a collective), as it must construct its CheckpointManager.
    ``timeout_s`` bounds every collective, including rank 0's wait in ``gather_parts`` for the
    slowest rank to finish writing: set it above the longest write phase of a save.
    """

    def __init__(self, *, timeout_s: float = 300.0, group: Any | None = None) -> None:
        if dist_world() is None:
            raise DistributedError("DistCoordinator needs torch.distributed to be initialised "
                                   "(dist.init_process_group) on every rank")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self.rank: int = dist.get_rank(self.group)
        self.world_size: int = dist.get_world_size(self.group)
        self._root = dist.get_global_rank(self.group, 0)
        self._broken: str | None = None
        self._closed = False

    # ---------------------------------------------------------------- transport
    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise DistributedError(f"rank {self.rank}: {what}: the coordinator is closed")
        if self._broken is not None:
            raise DistributedError(f"rank {self.rank}: {what}: the checkpoint group is unusable "
                                   f"after an earlier failure ({self._broken})")

    def _fail(self, what: str, err: BaseException | None) -> DistributedError:
        if err is None:
            why = f"timed out after {self.timeout_s:g}s"
        else:
            why = f"{type(err).__name__}: {str(err).strip()[:500]}"
        msg = (f"rank {self.rank}/{self.world_size}: {what} failed ({why}); a peer rank died, "
               "hung, or failed before reaching this step")
        self._broken = msg
        return DistributedError(msg)

    async def _collective(self, what: str, fn: Callable[[], T]) -> T:
        """Run blocking ``fn`` on a daemon thread; await it with a bound; map failures."""
        self._check_usable(what)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        def body() -> None:
            try:
                value: Any = fn()
                ok = True
            except BaseException as err:
                value, ok = err, False
            # the loop may have closed while we were blocked; then nobody listens
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, ok, value)

        threading.Thread(target=body, name=f"mithril-dist-{what}", daemon=True).start()
        try:
            return await asyncio.wait_for(fut, self.timeout_s + _GRACE_S)
        except asyncio.CancelledError:  # the thread stays in the collective: out of step now
            self._broken = f"rank {self.rank}: {what} was cancelled"
            raise
        except TimeoutError:
            raise self._fail(what, None) from None
        except Exception as err:
            raise self._fail(what, err) from err

    def _blocking(self, what: str, fn: Callable[[], T]) -> T:
        """Synchronous twin of :meth:`_collective` for construction-time agreement."""
        self._check_usable(what)
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                box["value"] = fn()
            except BaseException as err:
                box["error"] = err

        t = threading.Thread(target=body, name=f"mithril-dist-{what}", daemon=True)
        t.start()
        t.join(self.timeout_s + _GRACE_S)
        if t.is_alive():
            raise self._fail(what, None)
        if "error" in box:
            raise self._fail(what, box["error"]) from box["error"]
        return box["value"]

    def _bcast_fn(self, obj: Any) -> Callable[[], Any]:
        def run() -> Any:
            box = [obj if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=self._root, group=self.group)
            return box[0]
        return run

    # ---------------------------------------------------------------- protocol
    def broadcast_from_zero(self, value: T, what: str = "broadcast") -> T:
        """Every rank returns rank 0's ``value`` (blocking; used for the run id)."""
        return self._blocking(what, self._bcast_fn(value))

    async def broadcast(self, value: T, what: str = "broadcast") -> T:
        """Every rank returns rank 0's ``value`` (other ranks pass anything, e.g. None);
        bounded and mapped to :class:`DistributedError` like every step of the protocol.
        Layers that commit along with a save (the tiers) send on this group with it."""
        out: T = await self._collective(what, self._bcast_fn(value))
        return out

    async def barrier(self, what: str = "barrier") -> None:
        """Wait until every rank got here (bounded by the timeout)."""
        await self._collective(what, lambda: dist.barrier(group=self.group))

    async def agree_version(self, claim: Callable[[], Awaitable[int]]) -> int:
        """Rank 0 claims the version; a failed claim fails the save on every rank alike."""
        payload: tuple[int | None, str | None] | None = None
        if self.rank == 0:
            try:
                payload = (await claim(), None)
            except Exception as err:
                payload = (None, f"rank 0 could not claim a version: {type(err).__name__}: "
                                 f"{err}")
        number, error = await self._collective("agree_version", self._bcast_fn(payload))
        if error is not None or number is None:
            raise DistributedError(error or "rank 0 sent no version number")
        return int(number)

    async def gather_parts(self, part: RankPart) -> list[RankPart] | None:
        """Rank 0 receives every rank's report (as plain dicts: no foreign classes pickled).

        Parts travel compact and without their piece layouts; then rank 0 names, for each
        layout, the lowest rank using it, and only those ranks send it (one more broadcast
        and gather): rank 0 receives each distinct layout once, not once per rank."""
        part = compact_part(part)
        got = await self._collective("gather_parts", self._gather_fn(
            part.model_dump(mode="json", exclude={"layouts"})))
        with gc_paused():
            parts = None if got is None else [RankPart.model_validate(d) for d in got]
        senders: dict[str, int] = await self._collective("gather_parts:layouts", self._bcast_fn(
            None if parts is None else layout_senders(parts)))
        if not senders:
            return parts
        mine = {lid: part.layouts[lid].model_dump(mode="json")
                for lid, r in senders.items() if r == self.rank}
        sent = await self._collective("gather_parts:layouts", self._gather_fn(mine))
        if parts is None or sent is None:
            return None
        with gc_paused():
            layouts = {lid: PieceLayout.model_validate(d)
                       for one in sent if one for lid, d in one.items()}
            return with_layouts(parts, layouts)

    def _gather_fn(self, obj: Any) -> Callable[[], list[Any] | None]:
        def run() -> list[Any] | None:
            out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(obj, out, dst=self._root, group=self.group)
            return out
        return run

    async def broadcast_outcome(self, outcome: Outcome | None) -> Outcome:
        sent = None if outcome is None else outcome.model_dump(mode="json")
        got = await self._collective("broadcast_outcome", self._bcast_fn(sent))
        if got is None:
            raise DistributedError(f"rank {self.rank}: rank 0 broadcast no outcome")
        return Outcome.model_validate(got)

    def close(self) -> None:
        """Destroy the checkpoint group (skipped when broken: a thread may still be in it)."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None and dist_world() is not None:
            with contextlib.suppress(Exception):  # the default group may be gone at shutdown
                dist.destroy_process_group(self.group)


#: names that moved to :mod:`mithril_async.sharded`, importable from here for a release
_MOVED = frozenset([
    "ShardTarget", "ShardedModel", "ShardedOptimizer", "check_target", "from_local",
    "piece_of", "pieces_of", "shard_pieces", "state_leaves", "target_of", "to_local",
])


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'mithril_async.distributed' has no attribute {name!r}")
    import warnings

    from mithril_async import sharded

    warnings.warn(f"mithril_async.distributed.{name} moved to mithril_async.sharded.{name}; "
                  "the old import path goes in the next release", DeprecationWarning,
                  stacklevel=2)
    return getattr(sharded, name)
