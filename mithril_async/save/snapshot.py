"""One save's snapshot as the encoder reads it, whichever process took it.

:class:`StateSnapshot` holds what a save staged (or streams) and what tells that the copy is
complete; a checkpoint worker fills it from its trainer's hand-off (:class:`HandedOff`: views
of the shared staging memory, no copy, no torch), the training process through
:class:`~mithril_async.save.trainer_snapshot.TrainerSnapshot`, which copies the live state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mithril_async.manifest import PieceMeta
from mithril_async.save.buffers import HostCopies
from mithril_async.save.context import SaveContext
from mithril_async.save.items import StagedItem

if TYPE_CHECKING:
    from mithril_async.pipeline.lossy import Roles
    from mithril_async.save.overlap import OverlapCopy, StreamCopy
    from mithril_async.save.stream_snapshot import StreamSnapshot

__all__ = ["HandedOff", "StateSnapshot"]


@dataclass
class HandedOff:
    """A staged snapshot taken by another process (a checkpoint worker's trainer): per item
    its ``skeleton``, the buffer set ``area`` it was staged into and its ``tensors`` (views
    of the trainer's staging memory); the JSON states, RNG document and shard pieces."""

    items: dict[str, dict[str, Any]]
    json_states: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    pieces: dict[str, dict[str, PieceMeta]] = field(default_factory=dict)
    #: a streamed save (host_memory_mib): the items' tensors are copied out chunk by chunk
    #: by the process that took it, on request (``items`` then hold no tensors); None: staged
    stream: Any = None
    #: the lossy tier's roles of the tensors (``"<item>/<tensor>"`` -> group, role)
    roles: dict[str, Any] = field(default_factory=dict)


class StateSnapshot:
    """One save's copy of the state, as the encoder reads it: what was staged (or will be
    streamed), and the objects that tell when the copy is complete. ``on_now`` is called once
    a streamed snapshot's ``now`` tensors are all copied out (the caller's stall ends there).

    This class holds a snapshot another process took (:meth:`adopt`: a checkpoint worker's);
    :class:`~mithril_async.save.trainer_snapshot.TrainerSnapshot` takes one of the live
    state."""

    def __init__(self, ctx: SaveContext, on_now: Callable[[], None] = lambda: None) -> None:
        self.ctx = ctx
        self.on_now = on_now
        self.staged: dict[str, HostCopies] = {}
        self.skeletons: dict[str, Any] = {}
        self.areas: dict[str, int] = {}
        self.json_states: dict[str, Any] = {}
        self.rng: dict[str, Any] = {}
        self.roles: Roles = {}
        #: per item: where each tensor sits in its global tensor (sharded state)
        self.pieces: dict[str, dict[str, PieceMeta]] = {}
        #: snapshot = "overlapped": the copy still running after save() returned
        self.overlap: OverlapCopy | None = None
        #: streamed under host_memory_mib: the live tensors the encoder copies out
        self.stream: StreamSnapshot | None = None
        #: streamed with snapshot = "overlapped": what the step pre-hook waits on
        self.stream_copy: StreamCopy | None = None
        #: host bytes of tensors that had to be copied whole to be streamed (non-contiguous)
        self._materialized = 0

    def adopt(self, handed: HandedOff, overlap: Any = None) -> None:
        """Take a snapshot another process staged (nothing is copied): each item's tensors
        become the buffers of its chain's buffer set, so the next save's delta base is
        there. ``overlap``: what says when the trainer's overlapped copy into them is
        complete (its ``finished()`` raises :class:`SnapshotTorn` when it was torn). A
        streamed snapshot's chunks are copied out on request by the process that took it."""
        ctx = self.ctx
        self.roles = {name: (str(r[0]), r[1]) for name, r in handed.roles.items()}
        if handed.stream is not None:
            self._adopt_stream(handed)
            return
        for name, item in handed.items.items():
            chain = ctx.chain(name)
            area, tensors = int(item["area"]), item["tensors"]
            chain.areas[area].adopt(tensors)
            self.areas[name] = area
            self.skeletons[name] = item["skeleton"]
            self.staged[name] = HostCopies(tensors, nbytes=sum(
                t.numel() * t.element_size() for t in tensors.values()))
        self.json_states, self.rng = handed.json_states, handed.rng
        self.pieces = handed.pieces
        self.overlap = overlap
        ctx.memory.set_fixed("staging", sum(a.nbytes for c in ctx.chains.values()
                                            for a in c.areas))
        ctx.memory.set_fixed("codec", ctx.encoder.budget.codec_scratch())

    def _adopt_stream(self, handed: HandedOff) -> None:
        """A streamed save is a keyframe with no staged copy: the chains restart (as they did
        where it was taken), and the codec lanes follow the ring's slots."""
        ctx, stream = self.ctx, handed.stream
        for chain in ctx.chains.values():
            chain.release()
            chain.reset()
        for name, item in handed.items.items():
            ctx.chain(name)
            self.areas[name] = 0
            self.skeletons[name] = item["skeleton"]
        self.json_states, self.rng = handed.json_states, handed.rng
        self.pieces = handed.pieces
        self.stream = stream
        lanes = len(stream.ring.arrays)
        ctx.encoder.lanes(lanes)
        ctx.memory.set_fixed("staging", 0)
        ctx.memory.set_fixed("ring", stream.ring.nbytes)
        ctx.memory.set_fixed("codec", ctx.encoder.budget.codec_scratch(lanes))

    def items(self) -> list[StagedItem]:
        """What the encoder gets: the staged copies, or the live tensors to copy out."""
        if self.stream is None:
            return [StagedItem(name, self.skeletons[name], snap.tensors, self.areas[name])
                    for name, snap in self.staged.items()]
        stream = self.stream
        return [StagedItem(name, self.skeletons[name], stream.tensors.get(name, {}),
                           0, stream.tensors.get(name, {}), stream.ring)
                for name in self.skeletons]

    def wait_consumed(self) -> None:
        """Streamed: block until the chunks the caller must not change have been copied out
        (all of them; with an overlapped snapshot all but the optimizer's). Else at once."""
        if self.stream is not None:
            concurrent.futures.wait([self.stream.now_done])

    async def consumed(self) -> None:
        """:meth:`wait_consumed` for an async caller."""
        if self.stream is not None:
            await asyncio.wrap_future(self.stream.now_done)

    def close(self) -> None:
        """The save is over: nobody waits for the copy-out any more, and what was copied
        whole to be streamed goes back to the budget."""
        if self.stream is not None:
            self.stream.close()
        self.ctx.memory.release(self._materialized)
        self._materialized = 0
