"""DTensor state (FSDP2 ``fully_shard``, tensor parallel) as the library saves and restores
it: each rank's local shards, the pieces they are of the global tensors (so a restore onto
another world size or mesh knows what to read), and the stateful faces of a sharded model and
its optimizer (:class:`ShardedModel`, :class:`ShardedOptimizer`).

The gloo protocol that ranks run to agree on a save is :mod:`mithril_async.distributed`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mithril_async.errors import DistributedError, ShapeMismatch
from mithril_async.live import Reshardable
from mithril_async.manifest import MeshSplit, PieceMeta
from mithril_async.restore.reshard import Box
from mithril_async.state import unique_name

log = logging.getLogger("mithril_async")

__all__ = [
    "ShardTarget", "ShardedModel", "ShardedOptimizer", "check_target", "from_local",
    "piece_of", "pieces_of", "shard_pieces", "state_leaves", "target_of", "to_local",
]


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


# -------------------------------------------------------------------- shard metadata
def state_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """``(name, leaf)`` of every tensor / numpy leaf of ``tree``, named exactly as
    :func:`~mithril_async.state.flatten_state` names them (same order, same ``#n`` for a
    repeated path), DTensors included: the shard metadata of a tree is keyed by the names its
    to_local() twin is stored under."""
    seen: set[str] = set()

    def name_for(path: str) -> str:
        name = unique_name(path, seen)
        seen.add(name)
        return name

    def walk(x: Any, path: str) -> Iterator[tuple[str, Any]]:
        if isinstance(x, (torch.Tensor, np.ndarray)):
            yield name_for(path), x
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            for i, v in enumerate(x):
                yield from walk(v, f"{path}/{i}")

    yield from walk(tree, "")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def piece_of(t: Any) -> PieceMeta | None:
    """Where ``t``'s local data sits in its global tensor; None when it is not a box.

    A DTensor sharded with ``Shard``/``Replicate`` placements holds one box of its global
    shape (``compute_local_shape_and_global_offset``); ``replicated`` when a ``Replicate``
    mesh dimension of size > 1 means other ranks hold the same box. A plain tensor (a
    step counter, an unsharded buffer) is the whole of itself, replicated on every rank.
    ``Partial`` (pending reductions) and strided shards (FSDP2 + TP ``_StridedShard``) are no
    box: such a tensor is saved but cannot be resharded.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard

    if isinstance(t, DTensor):
        placements = tuple(t.placements)
        if not all(type(p) in (Shard, Replicate) for p in placements):
            return None
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              placements)
        mesh_shape = t.device_mesh.shape
        replicated = any(isinstance(p, Replicate) and mesh_shape[i] > 1
                         for i, p in enumerate(placements))
        coord = t.device_mesh.get_coordinate()
        split = None if coord is None else MeshSplit(
            mesh=list(mesh_shape), coord=list(coord),
            dims=[p.dim if isinstance(p, Shard) else None for p in placements])
        return PieceMeta(global_shape=list(t.shape), offsets=list(offset), lengths=list(shape),
                         dtype=_dtype_name(t), replicated=replicated, split=split)
    if isinstance(t, torch.Tensor):
        return PieceMeta(global_shape=list(t.shape), offsets=[0] * t.dim(),
                         lengths=list(t.shape), dtype=_dtype_name(t), replicated=True)
    return None


def shard_pieces(tree: Any) -> dict[str, PieceMeta]:
    """The shard metadata of every tensor of a state tree holding DTensors, by stored name.
    Empty when the tree holds no DTensor (nothing to reshard) or some tensor is no box."""
    from torch.distributed.tensor import DTensor

    out: dict[str, PieceMeta] = {}
    sharded = False
    for name, leaf in state_leaves(tree):
        sharded = sharded or isinstance(leaf, DTensor)
        piece = piece_of(leaf)
        if piece is None:
            if isinstance(leaf, torch.Tensor):
                log.info("%s: %s placements are no box; this state is saved without shard "
                         "metadata and restores only on the same mesh", name,
                         getattr(leaf, "placements", "?"))
                return {}
            continue  # a numpy array: not sharded state
        out[name] = piece
    return out if sharded else {}


def pieces_of(obj: Any, names: Collection[str]) -> dict[str, PieceMeta]:
    """The shard metadata ``obj`` (a :class:`ShardedModel` / :class:`ShardedOptimizer`)
    captured at its last ``state_dict()``, for the flattened tensor ``names`` of that
    state dict; empty for any other object, or if the names disagree (then nothing claims
    to be reshardable)."""
    pieces = obj.shard_pieces if isinstance(obj, Reshardable) else {}
    if not pieces:
        return {}
    if set(pieces) != set(names):
        log.warning("shard metadata names %d tensors, the state dict %d: saved without it",
                    len(pieces), len(names))
        return {}
    return pieces


@dataclass
class ShardTarget:
    """Where a restore writes one tensor of this rank: ``local`` (contiguous, CPU) holds the
    box ``box`` of a global tensor of ``global_shape``; ``value`` is what goes into the state
    tree handed to ``set_*_state_dict`` (the DTensor around ``local``, or ``local`` itself)."""

    value: Any
    local: torch.Tensor
    box: Box
    global_shape: tuple[int, ...]
    dtype: torch.dtype


def target_of(name: str, t: Any) -> ShardTarget:
    """The target a live (D)Tensor offers: its local memory and the box it holds."""
    from torch.distributed.tensor import DTensor

    piece = piece_of(t)
    local = t._local_tensor if isinstance(t, DTensor) else t
    if piece is None or not isinstance(local, torch.Tensor):
        raise DistributedError(f"tensor {name!r}: {getattr(t, 'placements', type(t))} cannot "
                               "be restored from pieces (no box: Partial or strided shards)")
    if local.device.type != "cpu" or not local.is_contiguous():
        raise DistributedError(f"tensor {name!r}: resharded restores write CPU contiguous "
                               f"local shards; this one is {local.device}, "
                               f"contiguous={local.is_contiguous()}")
    return ShardTarget(t, local.detach(), Box.of(piece.offsets, piece.lengths),
                       tuple(piece.global_shape), local.dtype)


def check_target(item: str, name: str, target: ShardTarget, saved: PieceMeta) -> None:
    """A live tensor must have the saved global shape and dtype (:class:`ShapeMismatch`
    naming the tensor, raised before anything is written)."""
    from mithril_async.state import TORCH_DTYPES

    if list(target.global_shape) != list(saved.global_shape):
        raise ShapeMismatch(f"{item}: tensor {name!r} is {list(target.global_shape)} here but "
                            f"was saved as {saved.global_shape} (global shape)")
    if TORCH_DTYPES.get(saved.dtype) != target.dtype:
        raise ShapeMismatch(f"{item}: tensor {name!r} is {target.dtype} here but was saved as "
                            f"{saved.dtype}")


def _live_targets(item: str, tree: Any, saved: Mapping[str, PieceMeta]
                  ) -> dict[str, ShardTarget]:
    live = dict(state_leaves(tree))
    out: dict[str, ShardTarget] = {}
    for name, piece in saved.items():
        if name not in live:
            raise ShapeMismatch(f"{item}: the version holds tensor {name!r}, this state has "
                                "no such tensor")
        out[name] = target_of(name, live[name])
        check_target(item, name, out[name], piece)
    return out


class ShardedModel:
    """Stateful face of a model whose parameters are DTensors (FSDP2 ``fully_shard``, tensor
    parallel): saves only this rank's shards, through ``get_model_state_dict``.

    Use with ``CheckpointManager(..., sharded_model=True)`` so every rank writes its shard.
    """

    def __init__(self, model: Any, options: Any | None = None) -> None:
        self.model, self.options = model, options
        #: shard metadata of the last state_dict(), by stored tensor name (the save records it)
        self.shard_pieces: dict[str, PieceMeta] = {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.model, options=self.options)
        self.shard_pieces = shard_pieces(sd)
        return dict(to_local(sd))

    def reshard_targets(self, saved: Mapping[str, PieceMeta]) -> dict[str, ShardTarget]:
        """Where a restore from pieces writes each saved tensor: the live DTensors' local
        shards (checked against the saved global shapes and dtypes)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return _live_targets("model", get_model_state_dict(self.model, options=self.options),
                             saved)

    def load_resharded(self, tree: dict[str, Any]) -> None:
        """Load a tree of this rank's (D)Tensors filled by a restore from pieces."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, tree, options=self.options)

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
        #: shard metadata of the last state_dict(), by stored tensor name (the save records it)
        self.shard_pieces: dict[str, PieceMeta] = {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = get_optimizer_state_dict(self.model, self.optimizer, options=self.options)
        self.shard_pieces = shard_pieces(sd)
        return dict(to_local(sd))

    def reshard_targets(self, saved: Mapping[str, PieceMeta]) -> dict[str, ShardTarget]:
        """Where a restore from pieces writes each saved tensor. The optimizer's live state
        when it has some; else (a fresh optimizer) new local tensors laid out like their
        parameter: ``state/<fqn>/exp_avg`` of a sharded piece follows parameter ``<fqn>``'s
        mesh and placements, and a replicated piece (the step counter) is a whole tensor."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        from mithril_async.state import TORCH_DTYPES

        # get_optimizer_state_dict of an optimizer without state creates it (a zero-lr
        # step): a fresh optimizer is not asked, so a refused restore leaves it as it was
        live = dict(state_leaves(get_optimizer_state_dict(
            self.model, self.optimizer, options=self.options))) if self.optimizer.state else {}
        params = get_model_state_dict(self.model, options=self.options)
        out: dict[str, ShardTarget] = {}
        for name, piece in saved.items():
            if name in live:
                out[name] = target_of(name, live[name])
                check_target("optimizer", name, out[name], piece)
                continue
            dtype = TORCH_DTYPES.get(piece.dtype)
            if dtype is None:
                raise ShapeMismatch(f"optimizer: tensor {name!r} was saved as {piece.dtype!r}, "
                                    "not a torch dtype")
            parts = name.split("/")
            param = params.get(parts[1]) if len(parts) == 3 and parts[0] == "state" else None
            if isinstance(param, DTensor) and list(param.shape) == piece.global_shape:
                local = torch.empty(tuple(param._local_tensor.shape), dtype=dtype)
                value: Any = DTensor.from_local(local, param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape,
                                                stride=param.stride())
                out[name] = target_of(name, value)
            elif piece.replicated:
                local = torch.empty(tuple(piece.global_shape), dtype=dtype)
                out[name] = target_of(name, local)
            else:
                raise ShapeMismatch(f"optimizer: tensor {name!r} (global {piece.global_shape}) "
                                    "has no parameter of that shape to follow here")
        return out

    def load_resharded(self, tree: dict[str, Any]) -> None:
        """Load a tree of this rank's (D)Tensors filled by a restore from pieces."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, tree, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        like = get_optimizer_state_dict(self.model, self.optimizer, options=self.options)
        set_optimizer_state_dict(self.model, self.optimizer, from_local(state_dict, like),
                                 options=self.options)
