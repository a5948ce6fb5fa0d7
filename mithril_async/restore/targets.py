"""Which live tensors a restore may decode straight into, and when loading may be skipped.

A restore decodes a version straight into the tensors a state object's ``state_dict()``
returns, which for a plain module are views of its live parameters and buffers. A state
dict may also hold copies: a module converting dtypes in ``_save_to_state_dict``, a
state-dict hook returning new tensors, FSDP's gathered full state dict. Bytes decoded into a
copy never reach the live state, so a tensor is a target only when its storage is proven to
be one of the object's live storages (:func:`live_targets`); the others are decoded into
fresh tensors and reach the object through ``load_state_dict``. A module's
``load_state_dict`` is skipped only when everything it would load was decoded into its live
tensors and nothing of its would run on load (:func:`loaded_in_place`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mithril_async.state import TensorDict

__all__ = ["live_storages", "live_targets", "loaded_in_place"]

#: the load methods a module may have without running anything of its own on load: torch's
_LOAD_METHODS = ("load_state_dict", "_load_from_state_dict", "set_extra_state")


def _storage_ptr(t: Any) -> int:
    """The address of ``t``'s storage (0: none we can write through, or not a plain tensor)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _live_tensors(obj: Any) -> Iterable[Any]:
    if isinstance(obj, torch.nn.Module):
        return itertools.chain(obj.parameters(), obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return (v for s in obj.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    if isinstance(obj, TensorDict):
        return obj.tensors.values()
    return ()


def live_storages(obj: Any) -> frozenset[int]:
    """Storage addresses holding ``obj``'s live state: a module's parameters and buffers, an
    optimizer's state tensors, a :class:`TensorDict`'s tensors; none for anything else (its
    state dict cannot be proven to be its state)."""
    return frozenset(p for t in _live_tensors(obj) if (p := _storage_ptr(t)))


def live_targets(obj: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``tensors`` (what ``obj.state_dict()`` gave, by stored name) that share
    storage with ``obj``'s live state, so that writing into them writes the state itself."""
    live = live_storages(obj)
    return {name: t for name, t in tensors.items() if _storage_ptr(t) in live}


def _torch_load_methods(module: torch.nn.Module) -> bool:
    cls = type(module)
    return all(getattr(cls, name).__module__.startswith("torch.nn.")
               for name in _LOAD_METHODS)


def _no_load_hooks(module: torch.nn.Module) -> bool:
    return not (module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks
                or module._state_dict_hooks or module._state_dict_pre_hooks)


def loaded_in_place(module: torch.nn.Module, tree: Any) -> bool:
    """Whether ``module.load_state_dict(tree)`` would change nothing: every entry of its
    state dict is a tensor, ``tree`` holds exactly those names, each a view of the very same
    bytes of a live parameter or buffer (so a restore decoded it in place), and no submodule
    runs code of its own on load (load hooks, state-dict hooks, load methods that are not
    torch's). Anything less and the caller loads."""
    if not isinstance(tree, dict):
        return False
    if not all(_no_load_hooks(m) and _torch_load_methods(m) for m in module.modules()):
        return False
    current = module.state_dict()
    if set(current) != set(tree):
        return False
    live = live_storages(module)
    for name, now in current.items():
        got = tree[name]
        if not (isinstance(now, torch.Tensor) and isinstance(got, torch.Tensor)):
            return False
        if (_storage_ptr(got) not in live or got.data_ptr() != now.data_ptr()
                or got.dtype != now.dtype or got.shape != now.shape
                or got.stride() != now.stride()):
            return False
    return True
