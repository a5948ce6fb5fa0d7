"""FSDP2-like sharded state of one simulated rank, without a process group.

Real sharded state (``ShardedModel`` / ``ShardedOptimizer`` over DTensors) needs one process
per rank. To run the save and restore of thousands of ranks in one process, each simulated
rank holds a :class:`SimShardedState`: the same face the manager sees from a
``ShardedModel`` (``state_dict()`` of this rank's local shards, ``shard_pieces`` recorded at
each ``state_dict()``, ``reshard_targets`` / ``load_resharded`` for restores from pieces),
with every box computed as torch computes a DTensor's on the given mesh
(:func:`~mithril_async.mesh_layout.mesh_box`; tested against torch's own function).

:func:`fsdp_state` builds a rank's model and AdamW-like optimizer: ``params`` parameters
(matrices and vectors, sharded on mesh dimension 0 as FSDP2 does, on dimension 1 of a 2-D
mesh as tensor parallelism does), each with ``exp_avg`` / ``exp_avg_sq`` sharded alike and a
plain ``step`` every rank holds whole. Values are a function of the global position
(``fill="index"``), so a restore on any world size can be checked bit for bit
(:meth:`SimShardedState.mismatches`), or one constant per tensor (``fill="const"``), so every
rank's shard of a tensor holds the same bytes (a benchmark may then write one rank's blobs
for many).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xxhash

from mithril_async.errors import ShapeMismatch
from mithril_async.manifest import MeshSplit, PieceMeta
from mithril_async.mesh_layout import mesh_box, replicated
from mithril_async.restore.reshard import Box
from mithril_async.sharded import ShardTarget, check_target

__all__ = ["Mesh", "SimShardedState", "TensorPlan", "fsdp_state", "mesh_for"]

Fill = Literal["index", "const"]


@dataclass(frozen=True)
class Mesh:
    """A device mesh of ``shape``; ranks are laid out row-major (``init_device_mesh``)."""

    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coord(self, rank: int) -> tuple[int, ...]:
        out = []
        for n in reversed(self.shape):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))


def mesh_for(world: int, tp: int = 1) -> Mesh:
    """A 1-D mesh of ``world`` ranks, or a 2-D ``(world // tp, tp)`` one (``tp`` > 1)."""
    if tp <= 1:
        return Mesh((world,))
    if world % tp:
        raise ValueError(f"world {world} is not a multiple of tp {tp}")
    return Mesh((world // tp, tp))


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the state: its global shape, and per mesh dimension the tensor
    dimension it is sharded on (None: replicated); ``dims`` None: a plain tensor every rank
    holds whole."""

    global_shape: tuple[int, ...]
    dims: tuple[int | None, ...] | None
    dtype: torch.dtype = torch.float32


def _salt(name: str) -> int:
    return xxhash.xxh64_intdigest(name.encode()) % (1 << 16)


def _values(name: str, shape: tuple[int, ...], box: Box, fill: Fill,
            dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``name``'s values on ``box`` (see the module docstring)."""
    if fill == "const" or not box.lengths:
        return torch.full(box.lengths, float(_salt(name) % 4096), dtype=dtype)
    idx = torch.zeros(box.lengths, dtype=torch.int64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        along = torch.arange(box.offsets[d], box.offsets[d] + box.lengths[d]) * stride
        idx += along.reshape([-1 if i == d else 1 for i in range(len(shape))])
        stride *= shape[d]
    return ((idx + _salt(name) * 64) % (1 << 20)).to(dtype)


class SimShardedState:
    """One simulated rank's sharded item (a model or an optimizer): ``tree`` maps the
    item's state-dict structure to local shards; ``plans`` each flattened tensor name
    (``a/b/c`` for nested dicts) to its :class:`TensorPlan`."""

    def __init__(self, plans: Mapping[str, TensorPlan], mesh: Mesh, rank: int, *,
                 fill: Fill = "index", extra: Mapping[str, Any] | None = None) -> None:
        self.plans = dict(plans)
        self.mesh = mesh
        self.rank = rank
        self.coord = mesh.coord(rank)
        self.fill: Fill = fill
        self.extra = dict(extra or {})
        #: where each local shard sits (``shard_pieces`` of the last ``state_dict()``)
        self.shard_pieces: dict[str, PieceMeta] = {}
        #: this rank's box of every tensor
        self.boxes = {name: self._box(p) for name, p in self.plans.items()}
        self.local = {name: self.expected(name) for name in self.plans}

    def _box(self, p: TensorPlan) -> Box:
        if p.dims is None:
            return Box(tuple(0 for _ in p.global_shape), p.global_shape)
        return Box(*mesh_box(p.global_shape, self.mesh.shape, p.dims, self.coord))

    def piece(self, name: str) -> PieceMeta:
        """Where this rank's shard of ``name`` sits, as a DTensor would record it."""
        p, box = self.plans[name], self.boxes[name]
        dtype = str(p.dtype).removeprefix("torch.")
        split = None if p.dims is None else MeshSplit(
            mesh=list(self.mesh.shape), dims=list(p.dims), coord=list(self.coord))
        return PieceMeta(global_shape=list(p.global_shape), offsets=list(box.offsets),
                         lengths=list(box.lengths), dtype=dtype,
                         replicated=p.dims is None or replicated(self.mesh.shape, p.dims),
                         split=split)

    def expected(self, name: str) -> torch.Tensor:
        """The values this rank's shard of ``name`` holds when saved (and after a restore)."""
        p = self.plans[name]
        return _values(name, p.global_shape, self.boxes[name], self.fill, p.dtype)

    def mismatches(self) -> list[str]:
        """The tensors whose local shard differs from :meth:`expected`."""
        return [n for n in self.plans if not torch.equal(self.local[n], self.expected(n))]

    def scramble(self) -> None:
        """Overwrite every local shard (so a restore has something to put right)."""
        for t in self.local.values():
            t.fill_(-1)

    # ---------------------------------------------------------------- the Stateful face
    def _tree(self) -> dict[str, Any]:
        tree: dict[str, Any] = dict(self.extra)
        for name, t in self.local.items():
            *path, leaf = name.split("/")
            node = tree
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = t
        return tree

    def state_dict(self) -> dict[str, Any]:
        self.shard_pieces = {name: self.piece(name) for name in self.plans}
        return self._tree()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for name, t in _leaves(state_dict):
            if name in self.local:
                self.local[name].copy_(t)

    def reshard_targets(self, saved: Mapping[str, PieceMeta]) -> dict[str, ShardTarget]:
        """Where a restore from pieces writes each saved tensor: the live local shards."""
        out: dict[str, ShardTarget] = {}
        for name, piece in saved.items():
            if name not in self.local:
                raise ShapeMismatch(f"the version holds tensor {name!r}, this state has no "
                                    "such tensor")
            t = self.local[name]
            out[name] = ShardTarget(t, t, self.boxes[name], self.plans[name].global_shape,
                                    t.dtype)
            check_target("sim", name, out[name], piece)
        return out

    def load_resharded(self, tree: Mapping[str, Any]) -> None:
        """The restore wrote into the live shards; anything else in ``tree`` is loaded."""
        self.load_state_dict(tree)


def _leaves(tree: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    for k, v in tree.items():
        name = f"{path}/{k}" if path else str(k)
        if isinstance(v, torch.Tensor):
            yield name, v
        elif isinstance(v, Mapping):
            yield from _leaves(v, name)


def fsdp_state(params: int, mesh: Mesh, rank: int, *, rows_per_rank: int = 4,
               fill: Fill = "index", saved_mesh: Mesh | None = None
               ) -> tuple[SimShardedState, SimShardedState]:
    """(model, optimizer) of one rank: ``params`` parameters alternating matrices and
    vectors. Global shapes follow ``saved_mesh`` (default ``mesh``): ``rows_per_rank`` rows
    per rank of its first dimension (and two columns per rank of a second), so the same
    global tensors can be laid out on another world size."""
    shape_mesh = saved_mesh or mesh
    rows = rows_per_rank * shape_mesh.shape[0]
    two_d = len(mesh.shape) == 2
    cols = 2 * shape_mesh.shape[1] if len(shape_mesh.shape) == 2 else 8
    model: dict[str, TensorPlan] = {}
    for i in range(params):
        fqn = f"layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}"
        if i % 2 == 0:
            model[fqn] = TensorPlan((rows, cols), (0, 1) if two_d else (0,))
        else:
            model[fqn] = TensorPlan((rows,), (0, None) if two_d else (0,))
    opt: dict[str, TensorPlan] = {}
    for fqn, p in model.items():
        opt[f"state/{fqn}/exp_avg"] = p
        opt[f"state/{fqn}/exp_avg_sq"] = p
        opt[f"state/{fqn}/step"] = TensorPlan((), None)
    groups = {"param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "params": list(model)}]}
    return (SimShardedState(model, mesh, rank, fill=fill),
            SimShardedState(opt, mesh, rank, fill=fill, extra=groups))
