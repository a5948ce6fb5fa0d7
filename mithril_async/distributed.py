"""The save protocol of :mod:`mithril_async.pipeline.coordinator` over ``torch.distributed``.

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
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mithril_async.errors import DistributedError
from mithril_async.pipeline.coordinator import Outcome, RankPart

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
        """Rank 0 receives every rank's report (as plain dicts: no foreign classes pickled)."""
        sent = part.model_dump(mode="json")

        def run() -> list[Any] | None:
            out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(sent, out, dst=self._root, group=self.group)
            return out

        got = await self._collective("gather_parts", run)
        if got is None:
            return None
        return [RankPart.model_validate(d) for d in got]

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


# -------------------------------------------------------------------- sharded state dicts
def to_local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's local shard (no copy, detached).

    The shard is read from the DTensor's ``_local_tensor`` when it has one: ``to_local()``
    goes through an autograd Function per tensor (a noticeable part of a sharded save's
    stall) to let gradients flow, which a snapshot never needs.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        local = getattr(tree, "_local_tensor", None)
        return local.detach() if isinstance(local, torch.Tensor) else tree.to_local().detach()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_local(v) for v in tree)
    return tree


def from_local(tree: Any, like: Any) -> Any:
    """Rebuild DTensors from local shards, taking mesh, placements and global shape from
    ``like`` (the live state dict): the shards must come from the same world size and mesh."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor):
        if tuple(tree.shape) != tuple(like.to_local().shape):
            raise DistributedError(f"local shard of shape {tuple(tree.shape)} does not fit this "
                                   f"rank's shard {tuple(like.to_local().shape)}; the mesh or "
                                   "world size changed (resharding is not supported)")
        return DTensor.from_local(tree, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    if isinstance(tree, dict) and isinstance(like, dict):
        return {k: from_local(v, like.get(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and isinstance(like, (list, tuple)) \
            and len(tree) == len(like):
        return type(tree)(from_local(v, w) for v, w in zip(tree, like, strict=True))
    return tree


class ShardedModel:
    """Stateful face of a model whose parameters are DTensors (FSDP2 ``fully_shard``, tensor
    parallel): saves only this rank's shards, through ``get_model_state_dict``.

    Use with ``CheckpointManager(..., sharded_model=True)`` so every rank writes its shard.
    """

    def __init__(self, model: Any, options: Any | None = None) -> None:
        self.model, self.options = model, options

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return dict(to_local(get_model_state_dict(self.model, options=self.options)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        like = get_model_state_dict(self.model, options=self.options)
        set_model_state_dict(self.model, from_local(state_dict, like), options=self.options)


class ShardedOptimizer:
    """Stateful face of an optimizer over DTensor parameters (FQN-keyed, this rank's shards),
    through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``."""

    def __init__(self, model: Any, optimizer: Any, options: Any | None = None) -> None:
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return dict(to_local(get_optimizer_state_dict(self.model, self.optimizer,
                                                      options=self.options)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        like = get_optimizer_state_dict(self.model, self.optimizer, options=self.options)
        set_optimizer_state_dict(self.model, self.optimizer, from_local(state_dict, like),
                                 options=self.options)
