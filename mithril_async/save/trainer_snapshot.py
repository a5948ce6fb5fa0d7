"""A save's snapshot of the state, taken on the caller's thread: staged, or streamed.

Staged (the default): every tensor is copied into its item chain's reused staging buffers
(:class:`~mithril_async.save.staging.StagingArea`); with ``snapshot = "overlapped"`` the
optimizer-owned tensors are copied by a background thread after ``save()`` returns
(:mod:`~mithril_async.save.overlap`).

Under ``[checkpointing.pipeline] host_memory_mib`` a state whose staged path (staging buffers,
2x with delta chains, plus the encode window) does not fit the budget *streams* instead: the
staging buffers are freed, and the live tensors are copied out chunk by chunk through a ring
of reused slots by the encoder (:class:`~mithril_async.save.stream_snapshot.StreamSnapshot`).
``save()`` then waits (:meth:`StateSnapshot.wait_consumed`) until every chunk it must not
change has been copied out: all of them with ``snapshot = "blocking"``; with ``"overlapped"``
all but the optimizer-owned ones, whose remaining copy-out the step pre-hook waits for
(:class:`~mithril_async.save.overlap.StreamCopy`). A streamed save is a keyframe: holding a
delta base whole is what the budget rules out, and reading base chunks back from the store
would cost a read and a decode of every chunk of the base per save; the chains restart once
the budget allows staging again.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from mithril_async.device import pinning
from mithril_async.errors import HostMemoryExceeded, UnsupportedStateType
from mithril_async.memory.budget import mib
from mithril_async.memory.ring import SlotRing
from mithril_async.pipeline.lossy import lossy_roles
from mithril_async.save.buffers import HostCopies
from mithril_async.save.items import StagedItem
from mithril_async.save.overlap import OverlapCopy, StepGuard, StreamCopy
from mithril_async.save.snapshot import StateSnapshot
from mithril_async.save.staging import PLAIN_TYPES, StagingArea
from mithril_async.save.stream_snapshot import StreamSnapshot
from mithril_async.sharded import pieces_of, to_local
from mithril_async.state import Stateful, capture_rng, flatten_state

__all__ = ["TrainerSnapshot"]

#: per item: its skeleton and its tensors by name
Flat = dict[str, tuple[Any, dict[str, torch.Tensor]]]


class TrainerSnapshot(StateSnapshot):
    """The training process's snapshot: :meth:`take` copies the live state (see module doc)."""

    def take(self, defer: frozenset[int], guard: StepGuard | None) -> list[HostCopies]:
        """Copy every stateful object's tensors into the chains' reused buffers (the stall).

        ``defer``: addresses of tensors an overlapped snapshot copies after ``save()``
        returns, on ``guard``'s copy threads. Returns the snapshots whose device copies the
        caller must wait for before the state may change. A state whose staged copy does not
        fit the budget is streamed instead (nothing is copied here; the caller then waits in
        :meth:`wait_consumed`)."""
        ctx = self.ctx
        flat: Flat = {}
        for name, obj in ctx.state.items():
            if isinstance(obj, Stateful):
                try:
                    flat[name] = flatten_state(obj.state_dict())
                except UnsupportedStateType as err:  # name the entry, not only the path in it
                    raise UnsupportedStateType(f"state[{name!r}]: {err}") from None
                self.pieces[name] = pieces_of(obj, flat[name][1])
            else:
                self.json_states[name] = obj.get_state()
        ctx.memory.reset_peak()
        if self._staged_fits(flat):
            self._stage(flat, defer)
        else:
            self._stream(flat, defer, guard)
        self.roles = lossy_roles(ctx.state) if ctx.lossy is not None else {}
        self.rng = capture_rng()
        if guard is not None and self.stream is None:
            self.overlap = self._start_overlap(guard)
        return list(self.staged.values())

    # ------------------------------------------------------------------ staged
    def _staged_fits(self, flat: Flat) -> bool:
        """Whether the staged path fits the budget: staging buffers (one set, two with delta
        chains) plus what each blob's encoding may hold at once."""
        budget = self.ctx.encoder.budget
        if budget.host.limit is None:
            return True
        sets = 2 if self.ctx.chain_policy.double_buffer else 1
        need = budget.codec_scratch()
        for name, (skeleton, tensors) in flat.items():
            item = StagedItem(name, skeleton, tensors)
            need += sets * item.nbytes + budget.write_reserve(self.ctx.encoder.demand(item))
        return need <= budget.host.limit

    def _stage(self, flat: Flat, defer: frozenset[int]) -> None:
        ctx = self.ctx
        if ctx.ring is not None:  # the budget allows staging again: the ring goes
            ctx.ring = None
            ctx.memory.set_fixed("ring", 0)
        for name, (skeleton, tensors) in flat.items():
            chain = ctx.chain(name)
            self.areas[name] = chain.write_idx
            area = chain.areas[chain.write_idx]
            assert isinstance(area, StagingArea)  # a training process's buffer sets copy
            self.staged[name] = area.snapshot(tensors, defer)
            self.skeletons[name] = skeleton
        ctx.memory.set_fixed("staging", sum(a.nbytes for c in ctx.chains.values()
                                            for a in c.areas))
        ctx.memory.set_fixed("codec", ctx.encoder.budget.codec_scratch())

    def _start_overlap(self, guard: StepGuard) -> OverlapCopy | None:
        """Start the background copy of every item's deferred tensors (one thread job)."""
        staged = list(self.staged.values())
        if not any(s.deferred or s.later_event is not None for s in staged):
            return None
        now = [s.event for s in staged if s.event is not None]
        for s in staged:  # the device copies are awaited by the pipeline, not by save()
            s.event = None
        copy = OverlapCopy([j for s in staged for j in s.deferred],
                           [w for s in staged for w in s.watch], guard.copy_threads,
                           events_now=now,
                           events_later=[s.later_event for s in staged
                                         if s.later_event is not None],
                           device_watch=[w for s in staged for w in s.later_watch])
        guard.pending = copy
        return copy

    # ------------------------------------------------------------------ streamed
    def _stream(self, flat: Flat, defer: frozenset[int], guard: StepGuard | None) -> None:
        """Hand the live tensors to the encoder through the slot ring (see module doc)."""
        ctx, memory = self.ctx, self.ctx.memory
        assert memory.limit is not None
        if ctx.lossy is not None:
            raise HostMemoryExceeded(
                "[checkpointing.lossy] keeps a reconstruction of the state's weights and "
                "moments in host memory, more than host_memory_mib = "
                f"{mib(memory.limit)} allows for this state; nothing was saved")
        for chain in ctx.chains.values():  # no staged copy, no delta base held
            chain.release()
            chain.reset()
        memory.set_fixed("staging", 0)
        admissions = {name: ctx.encoder.budget.admission(ctx.encoder.demand(
                          StagedItem(name, skel, tensors, stream={})))  # as streamed
                      for name, (skel, tensors) in flat.items()}
        ring = self._ring(max(admissions.values(), default=0))
        self._check_fits(flat, admissions)
        stream = StreamSnapshot(ring, self.on_now)
        try:
            for name, (skeleton, tensors) in flat.items():
                ctx.chain(name)
                self.areas[name] = 0
                self.skeletons[name] = skeleton
                if ctx.whole_model(name) and ctx.rank != 0:
                    continue  # rank 0 alone writes it
                for tname, src in tensors.items():
                    t = self._streamable(f"{name}/{tname}", src)
                    later = bool(t.numel()) and t.data_ptr() in defer
                    stream.add(name, tname, t, later)
        except BaseException:
            memory.release(self._materialized)
            self._materialized = 0
            raise
        stream.start()
        self.stream = stream
        if guard is not None and stream.later_left:
            self.stream_copy = guard.pending = StreamCopy(stream)

    def _check_fits(self, flat: Flat, admissions: dict[str, int]) -> None:
        """What cannot be split must fit at once beside the ring and codec buffers: each
        blob's admission and each JSON state; :class:`HostMemoryExceeded` names what does
        not."""
        memory = self.ctx.memory
        limit = memory.limit
        assert limit is not None
        for name, need in admissions.items():
            if need > limit - memory.fixed:
                raise HostMemoryExceeded(_too_big(name, flat[name][0], need, limit,
                                                  memory.fixed))
        for name, value in self.json_states.items():
            size = len(json.dumps(value, default=str))
            if size > limit - memory.fixed:
                raise HostMemoryExceeded(
                    f"the state of {name!r} (get_state(), {mib(size)} as JSON) cannot be "
                    f"split and exceeds host_memory_mib = {mib(limit)}; nothing was saved")

    def _ring(self, admission: int) -> SlotRing:
        """The slot ring and codec lanes for this budget: as many lanes (ring slots and
        codec threads) as the budget leaves room for beside one blob's ``admission``."""
        ctx = self.ctx
        budget = ctx.encoder.budget
        lanes = budget.lanes(admission)
        ctx.encoder.lanes(lanes)
        ctx.memory.set_fixed("codec", budget.codec_scratch(lanes))
        chunk = budget.chunk_bytes
        pin = pinning()
        ring = ctx.ring
        if ring is None or len(ring.buffers) != lanes or ring.slot_bytes != chunk \
                or ring.pinned != pin:
            ctx.ring = None
            ctx.memory.set_fixed("ring", 0)
            ring = ctx.ring = SlotRing(lanes, chunk, pin, alloc=ctx.ring_alloc)
            ctx.memory.set_fixed("ring", ring.nbytes)
        return ring

    def _streamable(self, where: str, src: torch.Tensor) -> torch.Tensor:
        """A plain contiguous tensor with ``src``'s values, streamed chunk by chunk: ``src``
        itself (a DTensor's local shard) when it is one, else a whole copy, which on the
        host must fit the budget at once."""
        t = to_local(src.detach())
        if type(t) in PLAIN_TYPES and t.is_contiguous() and not t.is_conj() \
                and not t.is_neg():
            return t
        n = t.numel() * t.element_size()
        if t.device.type == "cpu":
            self.ctx.memory.take(n, f"tensor {where!r} (not contiguous: copied whole "
                                    "before it is streamed)")
            self._materialized += n
        return t.resolve_conj().resolve_neg().contiguous().as_subclass(torch.Tensor)


def _too_big(item: str, skeleton: Any, need: int, limit: int, fixed: int) -> str:
    """The message for an item whose unsplittable part (its non-tensor values, which travel
    in the blob header) does not fit the budget: it names the biggest such value."""
    path, size = _largest_value(skeleton, item)
    return (f"saving {item!r} needs {mib(need)} of host memory at once, mostly its non-tensor "
            f"values; the largest is {path!r} ({mib(size)} as JSON), which cannot be split; "
            f"host_memory_mib = {mib(limit)} leaves {mib(limit - fixed)} beside the "
            f"{mib(fixed)} of slot ring and codec buffers; nothing was saved")


def _largest_value(node: Any, path: str) -> tuple[str, int]:
    """Descend into the child holding most of ``node``'s JSON while one does."""
    size = len(json.dumps(node, separators=(",", ":")))
    children: list[tuple[str, Any]] = []
    if isinstance(node, dict) and isinstance(node.get("D"), list):
        children = [(f"{path}/{k if isinstance(k, str) else json.dumps(k)}", v)
                    for k, v in (kv for kv in node["D"] if isinstance(kv, list) and len(kv) == 2)]
    elif isinstance(node, dict):
        children = [(path, v) for v in node.values()]
    elif isinstance(node, list):
        children = [(f"{path}/{i}", v) for i, v in enumerate(node)]
    if children:
        sizes = [(len(json.dumps(v, separators=(",", ":"))), p, v) for p, v in children]
        best = max(sizes, key=lambda x: x[0])
        if best[0] * 2 > size:
            return _largest_value(best[2], best[1])
    return path, size
