"""Many simulated ranks of one job in one process: the save protocol's collectives in memory.

:class:`SimGroup` stands for a job of ``world_size`` ranks; :meth:`SimGroup.coordinator`
gives each rank its :class:`SimCoordinator`. A ``SimCoordinator`` *is* the library's
:class:`~mithril_async.distributed.DistCoordinator` (the same ``agree_version``,
``gather_parts``, ``broadcast_outcome``: what each rank sends, when rank 0 validates, the
second round that brings each piece layout to rank 0 once) with the gloo transport replaced
by an in-memory one: a broadcast hands rank 0's pickled value to every rank, a gather hands
rank 0 every rank's pickled value, as ``broadcast_object_list`` / ``gather_object`` do. Ranks
may run on any threads and event loops (one manager per rank, each with its background loop,
or thousands of lightweight rank coroutines on one loop): a collective waits on a
:class:`concurrent.futures.Future`, so no thread blocks per waiting rank.

For measurements the group can hold rank 0 at a collective until :meth:`SimGroup.release`
(everything before it has arrived, nothing after it has started) and reports every rank's
arrival at every collective (:attr:`SimGroup.on_arrive`, :meth:`SimGroup.wait_arrived`).
Ranks whose steps disagree (one gathers while another broadcasts) fail with
:class:`~mithril_async.errors.DistributedError`, as a mismatched real group would hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mithril_async.distributed import DistCoordinator
from mithril_async.errors import DistributedError

__all__ = ["SimCoordinator", "SimGroup"]

T = TypeVar("T")


@dataclass
class _Round:
    """One collective of the group, by sequence number."""

    what: str
    #: rank 0's pickled value (broadcast) or the list of every rank's (gather)
    result: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    values: dict[int, bytes] = field(default_factory=dict)
    left: int = 0


@dataclass(frozen=True)
class _Op:
    """A collective as DistCoordinator describes it (its transport is ours)."""

    kind: str  # "broadcast" | "gather"
    value: Any

    def __call__(self) -> Any:  # pragma: no cover - never run as a blocking function
        raise DistributedError("a simulated collective runs on the SimGroup, not a thread")


class SimGroup:
    """A job of ``world_size`` simulated ranks (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._lock = threading.Lock()
        self._rounds: dict[int, _Round] = {}
        self._arrived: dict[str, set[int]] = {}
        self._cond = threading.Condition(self._lock)
        self._held: dict[str, threading.Event] = {}
        #: ``on_arrive(what, rank)`` at every rank's entry into every collective
        self.on_arrive: Callable[[str, int], None] | None = None
        #: collectives completed (every rank arrived), by name
        self.completed: dict[str, int] = {}
        #: what the ranks named by :meth:`keep` sent in a gather, by (collective, rank)
        self.kept: dict[tuple[str, int], Any] = {}
        self._keep: dict[str, set[int]] = {}

    def coordinator(self, rank: int) -> SimCoordinator:
        """Rank ``rank``'s coordinator (one per rank)."""
        return SimCoordinator(self, rank)

    # ------------------------------------------------------------ measurement hooks
    def hold(self, what: str) -> None:
        """Keep rank 0 inside the next collectives named ``what`` (after every rank has
        arrived) until :meth:`release`."""
        self._held[what] = threading.Event()

    def release(self, what: str) -> None:
        """Let rank 0 go on from a held collective (and stop holding it)."""
        gate = self._held.pop(what, None)
        if gate is not None:
            gate.set()

    def keep(self, what: str, ranks: set[int]) -> None:
        """Record what ``ranks`` send in gathers named ``what`` (:attr:`kept`)."""
        self._keep[what] = set(ranks)

    def wait_arrived(self, what: str, rank: int, timeout: float | None = None) -> bool:
        """Block until ``rank`` has entered a collective named ``what`` (since the last
        :meth:`forget`); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: rank in self._arrived.get(what, ()), timeout)

    def arrived(self, what: str) -> int:
        """How many ranks entered collectives named ``what`` (since the last :meth:`forget`)."""
        with self._lock:
            return len(self._arrived.get(what, ()))

    def forget(self) -> None:
        """Clear the arrival records (between two saves)."""
        with self._lock:
            self._arrived.clear()

    # ------------------------------------------------------------ transport
    def _round(self, seq: int, what: str) -> _Round:
        rnd = self._rounds.get(seq)
        if rnd is None:
            rnd = self._rounds[seq] = _Round(what, left=self.world_size)
        elif rnd.what != what:
            raise DistributedError(f"collective #{seq}: one rank is in {rnd.what!r}, "
                                   f"another in {what!r}: the ranks are out of step")
        return rnd

    def _arrive(self, what: str, rank: int) -> None:
        self._arrived.setdefault(what, set()).add(rank)
        self._cond.notify_all()

    def _leave(self, seq: int, rnd: _Round) -> None:
        rnd.left -= 1
        if rnd.left == 0:
            self._rounds.pop(seq, None)
            self.completed[rnd.what] = self.completed.get(rnd.what, 0) + 1

    async def broadcast(self, seq: int, what: str, rank: int, value: Any) -> Any:
        with self._lock:
            rnd = self._round(seq, what)
            self._arrive(what, rank)
            if rank == 0:
                rnd.result.set_result(pickle.dumps(value))
        if self.on_arrive is not None:
            self.on_arrive(what, rank)
        data = await asyncio.wrap_future(rnd.result)
        with self._lock:
            self._leave(seq, rnd)
        return value if rank == 0 else pickle.loads(data)

    async def gather(self, seq: int, what: str, rank: int, value: Any) -> list[Any] | None:
        data = pickle.dumps(value)
        with self._lock:
            if rank in self._keep.get(what, ()):
                self.kept[what, rank] = pickle.loads(data)
            rnd = self._round(seq, what)
            self._arrive(what, rank)
            rnd.values[rank] = data
            if len(rnd.values) == self.world_size:
                rnd.result.set_result(None)
            gate = self._held.get(what) if rank == 0 else None
        if self.on_arrive is not None:
            self.on_arrive(what, rank)
        if rank != 0:
            with self._lock:
                self._leave(seq, rnd)
            return None
        await asyncio.wrap_future(rnd.result)
        if gate is not None:
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        with self._lock:
            values = rnd.values
            self._leave(seq, rnd)
        return [pickle.loads(values[r]) for r in range(self.world_size)]


class SimCoordinator(DistCoordinator):
    """One rank of a :class:`SimGroup`: DistCoordinator's protocol over the group's
    in-memory transport (no torch.distributed, no threads)."""

    def __init__(self, group: SimGroup, rank: int) -> None:  # no super(): no process group
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank {rank} outside a world of {group.world_size}")
        self.group = group
        self.timeout_s = float("inf")
        self.rank = rank
        self.world_size = group.world_size
        self._root = 0
        self._broken: str | None = None
        self._closed = False
        self._seq = 0

    def _bcast_fn(self, obj: Any) -> Callable[[], Any]:
        return _Op("broadcast", obj)

    def _gather_fn(self, obj: Any) -> Callable[[], list[Any] | None]:
        return _Op("gather", obj)

    async def _collective(self, what: str, fn: Callable[[], T]) -> T:
        self._check_usable(what)
        if not isinstance(fn, _Op):
            raise DistributedError(f"rank {self.rank}: {what}: a simulated group runs only "
                                   "broadcasts and gathers")
        seq, self._seq = self._seq, self._seq + 1
        try:
            if fn.kind == "broadcast":
                out: Any = await self.group.broadcast(seq, what, self.rank, fn.value)
            else:
                out = await self.group.gather(seq, what, self.rank, fn.value)
        except asyncio.CancelledError:
            self._broken = f"rank {self.rank}: {what} was cancelled"
            raise
        except Exception as err:
            raise self._fail(what, err) from err
        return out

    def _blocking(self, what: str, fn: Callable[[], T]) -> T:
        """Construction-time agreement (the run id): rank 0 must get here first."""
        return asyncio.run(self._collective(what, fn))

    def close(self) -> None:
        self._closed = True
