"""State entries as PyTorch users write them: nested dicts and lists of tensors and values.

A state passed to the manager may hold, beside modules, optimizers and objects with
``state_dict()`` / ``get_state()``, plain entries: a tensor, a numpy array, a dict or list
nesting tensors, numbers, strings, bytes and ``None`` (``{"weights": {...}}``,
``{"model": m, "step": 5}``, an ``"extra"`` dict of tensors and counters). Each becomes a
:class:`PlainEntry`: saved like any state dict (tensors as tensors, the rest in the blob's
JSON skeleton; nothing is pickled, anything else is refused naming its key), and restored
into the very objects the user holds: tensors in place (``copy_``, so code holding them sees
the restored values), every other value written back into its dict or list, a top-level
value into the state mapping given to the manager.

A restore checks every plain entry's tree before it writes any value back: a tensor of
another shape or dtype, a list whose length changed, a value where a container was (or the
reverse) is a typed error naming the key (the restore then reports no success; tensors it
could decode straight into their live memory may hold the saved values already).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from mithril_async.errors import ShapeMismatch, UnsupportedStateType

__all__ = ["PlainEntry", "bind_state", "is_plain"]

#: leaves a plain entry holds besides tensors, numpy arrays and containers
_VALUES = (int, float, bool, str, bytes, type(None), np.integer, np.floating, np.bool_)


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a plain state entry (its leaves are checked when it is saved)."""
    return isinstance(value, (torch.Tensor, np.ndarray, dict, list, *_VALUES))


class PlainEntry:
    """``owner[key]``, a plain state entry, as a stateful object (see module doc)."""

    def __init__(self, owner: Mapping[str, Any], key: str) -> None:
        self.owner = owner
        self.key = key

    @property
    def value(self) -> Any:
        return self.owner[self.key]

    def state_dict(self) -> dict[str, Any]:
        """A dict as it is (its keys name its tensors, as a module's state dict does); any
        other value under one key, ``v``."""
        value = self.value
        return value if isinstance(value, dict) else {"v": value}

    def tensors(self) -> Iterator[torch.Tensor]:
        """The live tensors of the entry (what a restore may decode straight into)."""
        yield from _tensors(self.value)

    def check(self, state_dict: Mapping[str, Any]) -> Any:
        """The saved value ``state_dict`` holds, checked to fit the live one (a typed error
        naming the key where it does not); nothing is written."""
        live = self.value
        if isinstance(live, dict):
            saved: Any = dict(state_dict)
        elif isinstance(state_dict, Mapping) and set(state_dict) == {"v"}:
            saved = state_dict["v"]
        else:
            raise ShapeMismatch(f"state[{self.key!r}]: saved a dict, the live state holds a "
                                f"{type(live).__name__}")
        _check(live, saved, self.key)
        return saved

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the saved tree into the live one: checked whole first, then written."""
        live = self.value
        saved = self.check(state_dict)
        if isinstance(live, (dict, list)) or _is_array(live):
            _merge(live, saved)
        elif not isinstance(self.owner, MutableMapping):
            raise UnsupportedStateType(
                f"state[{self.key!r}]: a value is restored by writing it back into the state "
                f"mapping, and the one given to the manager ({type(self.owner).__name__}) "
                "cannot be written")
        else:
            self.owner[self.key] = saved


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, list):
        for v in x:
            yield from _tensors(v)


def _check(live: Any, saved: Any, path: str) -> None:
    """Raise naming ``path`` where ``saved`` cannot be written into ``live``."""
    if _is_array(live):
        if not _is_array(saved):
            raise ShapeMismatch(f"state[{path!r}]: saved a {type(saved).__name__}, the live "
                                f"state holds an array")
        if tuple(saved.shape) != tuple(live.shape) or str(saved.dtype) != str(live.dtype):
            raise ShapeMismatch(f"state[{path!r}]: saved {saved.dtype}{list(saved.shape)}, "
                                f"the live tensor is {live.dtype}{list(live.shape)}")
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise ShapeMismatch(f"state[{path!r}]: saved a {type(saved).__name__}, the live "
                                "state holds a dict")
        for k, v in saved.items():
            if k in live:
                _check(live[k], v, f"{path}/{k}")
    elif isinstance(live, list):
        if not isinstance(saved, list) or len(saved) != len(live):
            what = (f"a list of {len(saved)}" if isinstance(saved, list)
                    else f"a {type(saved).__name__}")
            raise ShapeMismatch(f"state[{path!r}]: saved {what}, the live list has "
                                f"{len(live)} element(s)")
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            _check(a, b, f"{path}/{i}")


def _merge(live: Any, saved: Any) -> None:
    """Write ``saved`` into ``live`` (checked by :func:`_check`): arrays in place, other
    values into their container (a key the live dict lacks is added)."""
    if isinstance(live, torch.Tensor):
        if saved.data_ptr() != live.data_ptr():  # decoded into it already: nothing to copy
            with torch.no_grad():
                live.copy_(saved if isinstance(saved, torch.Tensor) else torch.from_numpy(saved))
        return
    if isinstance(live, np.ndarray):
        live[...] = saved
        return
    items = live.items() if isinstance(live, dict) else enumerate(live)
    for k, v in list(items):
        if isinstance(live, dict) and k not in saved:
            continue  # kept as it is: the version does not hold it
        new = saved[k]
        if isinstance(v, (dict, list)) or _is_array(v):
            _merge(v, new)
        else:
            live[k] = new
    if isinstance(live, dict):
        for k, new in saved.items():
            if k not in live:
                live[k] = new


def bind_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The manager's items: each entry of ``state`` as it is where it has ``state_dict()`` /
    ``load_state_dict()`` or ``get_state()`` / ``set_state()``, a plain entry as a
    :class:`PlainEntry` over ``state`` itself (written back there on restore); anything else
    is refused naming its key."""
    from mithril_async.state import JsonStateful, Stateful

    out: dict[str, Any] = {}
    for name, obj in state.items():
        if not isinstance(name, str):
            raise UnsupportedStateType(f"state key {name!r}: the state's keys must be strings")
        if isinstance(obj, (Stateful, JsonStateful)):
            out[name] = obj
        elif is_plain(obj):
            out[name] = PlainEntry(state, name)
        else:
            raise UnsupportedStateType(
                f"state[{name!r}] is a {type(obj).__module__}.{type(obj).__qualname__}: an "
                "entry is a module, an optimizer, an object with state_dict() / "
                "load_state_dict() or get_state() / set_state(), or a plain value (tensors, "
                "numpy arrays, dicts and lists of them, numbers, strings, bytes, None)")
    return out
