"""The user's live state, bound once per manager: one typed binding per item.

What a manager saves and restores is a mapping of items. How each is read and written depends
on what it is, and that is worked out here, once, when the manager is made, instead of by
probing the objects wherever they are used:

- ``module`` (a ``torch.nn.Module``), ``optimizer`` (a ``torch.optim.Optimizer``) and
  ``stateful`` (anything else with ``state_dict()`` / ``load_state_dict()``): saved as their
  state dict; a module's tensors may be decoded straight into its own on restore;
- ``sharded``: a :class:`Reshardable` item (:class:`~mithril_async.sharded.ShardedModel`,
  :class:`~mithril_async.sharded.ShardedOptimizer`): its pieces are recorded, and a restore on
  any world size or mesh writes the saved pieces overlapping its own shards into it;
- ``json``: ``get_state()`` / ``set_state()`` (a data loader's position), per rank;
- ``plain``: a plain value of the user's mapping (:class:`~mithril_async.plain_state.PlainEntry`),
  written back into that mapping on restore.

Each binding also finds the optimizer the item is or wraps (``.optimizer``: a sharded
optimizer, an integration's adapter), which an overlapped snapshot guards. Anything else in
the mapping is refused, naming its key (:func:`~mithril_async.plain_state.bind_state`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from mithril_async.manifest_pieces import PieceMeta
from mithril_async.plain_state import PlainEntry, bind_state
from mithril_async.restore.targets import live_targets
from mithril_async.state import Stateful, flatten_state

__all__ = ["Binding", "Kind", "LiveState", "Reshardable"]

Kind = Literal["module", "optimizer", "stateful", "sharded", "json", "plain"]


@runtime_checkable
class Reshardable(Protocol):
    """An item whose state is restored from pieces on any world size: ``shard_pieces`` (the
    pieces of its last ``state_dict()``, by flattened tensor name), ``reshard_targets`` (where
    the saved pieces go on this rank) and ``load_resharded`` (what was decoded, loaded)."""

    shard_pieces: dict[str, PieceMeta]

    def state_dict(self) -> dict[str, Any]: ...

    def reshard_targets(self, saved: Mapping[str, PieceMeta]) -> dict[str, Any]: ...

    def load_resharded(self, tree: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Binding:
    """How one item of the live state is saved and restored (module docstring)."""

    name: str
    obj: Any
    kind: Kind

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the item is or wraps in an ``.optimizer`` attribute (looked up when
        asked, as any attribute: a wrapper may make it late, or delegate it through
        ``__getattr__``); None: none."""
        obj = self.obj
        opt = obj if isinstance(obj, torch.optim.Optimizer) else getattr(obj, "optimizer", None)
        return opt if isinstance(opt, torch.optim.Optimizer) else None

    @property
    def module(self) -> torch.nn.Module | None:
        """The module the item is or wraps in a ``.model`` attribute (a sharded model);
        None: none."""
        obj = self.obj
        mod = obj if isinstance(obj, torch.nn.Module) else getattr(obj, "model", None)
        return mod if isinstance(mod, torch.nn.Module) else None

    @property
    def stateful(self) -> bool:
        """Saved as a state dict (every kind but ``json``)."""
        return self.kind != "json"


def _bind(name: str, obj: Any) -> Binding:
    kind: Kind
    if isinstance(obj, PlainEntry):
        kind = "plain"
    elif isinstance(obj, Reshardable):
        kind = "sharded"
    elif isinstance(obj, torch.nn.Module):
        kind = "module"
    elif isinstance(obj, torch.optim.Optimizer):
        kind = "optimizer"
    elif isinstance(obj, Stateful):
        kind = "stateful"
    else:
        kind = "json"
    return Binding(name, obj, kind)


class LiveState(Mapping[str, Any]):
    """The live state of one manager: the items (as a mapping of the objects saved and
    restored) and their :class:`Binding`\\ s. Unsupported entries are refused here."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.bindings: dict[str, Binding] = {
            name: _bind(name, obj) for name, obj in bind_state(state).items()}

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name].obj

    def __iter__(self) -> Iterator[str]:
        return iter(self.bindings)

    def __len__(self) -> int:
        return len(self.bindings)

    def reshardable(self, name: str) -> Reshardable | None:
        """Item ``name`` if it restores from pieces (kind ``sharded``); None otherwise."""
        b = self.bindings.get(name)
        return b.obj if b is not None and b.kind == "sharded" else None

    @property
    def has_json_states(self) -> bool:
        """Some item is a ``json`` one: a reshard maps every saved rank's states."""
        return any(b.kind == "json" for b in self.bindings.values())

    def reshard_targets(self, item: str, pieces: dict[str, PieceMeta]
                        ) -> dict[str, Any] | None:
        """Where this rank writes each tensor of sharded item ``item`` from the saved
        ``pieces``; None for any other item (a restore plan asks:
        :class:`~mithril_async.restore.plan.LiveTargets`)."""
        obj = self.reshardable(item)
        return None if obj is None else obj.reshard_targets(pieces)

    def in_place_targets(self, item: str) -> Mapping[str, torch.Tensor] | None:
        """The live tensors of a (not sharded, not JSON) item by stored name, to decode
        straight into: those of its ``state_dict()`` proven to share storage with its live
        parameters, buffers or optimizer state (a state dict may hold copies: those are
        decoded into fresh tensors and loaded)."""
        b = self.bindings.get(item)
        if b is None or b.kind in ("json", "sharded"):
            return None
        return live_targets(b.obj, flatten_state(b.obj.state_dict())[1])

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers the items are or wrap, each once."""
        found: list[torch.optim.Optimizer] = []
        for b in self.bindings.values():
            opt = b.optimizer
            if opt is not None and all(opt is not o for o in found):
                found.append(opt)
        return found
