"""Framework checkpoint trees: opt-in pickling of the leaves a state skeleton cannot express,
and snapshots that share nothing mutable with the live tree.

The library stores state trees as tensors + a JSON skeleton and never pickles, so loading never
runs code. Framework checkpoints (Lightning ``hyper_parameters``, DeepSpeed's loss scaler and
config objects) hold arbitrary Python objects that the frameworks themselves pickle. These two
functions let an integration keep the tensors compressed and pickle *only* the leaves the
skeleton cannot hold, each replaced by a one-key marker dict; unpickling happens only when the
caller allows it, otherwise loading fails with a clear error.

:func:`snapshot` copies a tree before a background write, so training may change the live
objects the moment the save call returns: every tensor and numpy array is copied, containers
are rebuilt, immutable leaves are shared, and any other leaf is refused (naming its path):
nothing goes to the writer by reference.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from mithril_async.errors import InvalidFormat, UnsupportedStateType

__all__ = ["MARKER", "pack_objects", "snapshot", "unpack_objects"]

MARKER = "__mithril_pickle__"
#: the leaves a skeleton stores as they are; none of them can change in place
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size,
          np.integer, np.floating, np.bool_)
_KEYS = (type(None), bool, int, float, str)


def _key_ok(k: Any) -> bool:
    return isinstance(k, _KEYS) or (isinstance(k, tuple) and all(_key_ok(x) for x in k))


def _is_marker(x: Any) -> bool:
    return isinstance(x, dict) and len(x) == 1 and isinstance(x.get(MARKER), bytes)


def pack_objects(tree: Any) -> tuple[Any, int]:
    """``tree`` with every leaf the skeleton cannot hold pickled into a marker; and their count."""
    count = 0

    def walk(x: Any) -> Any:
        nonlocal count
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            return x
        if isinstance(x, np.ndarray) and x.dtype != object:
            return x
        if isinstance(x, _PLAIN):
            return x
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        if _is_marker(x):  # already packed: packing is idempotent, the count stays right
            count += 1
            return x
        if isinstance(x, dict) and all(_key_ok(k) for k in x):  # subclasses become dicts
            return {k: walk(v) for k, v in x.items()}
        count += 1
        return {MARKER: pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)}

    return walk(tree), count


def unpack_objects(tree: Any, *, allow_pickle: bool, where: str) -> Any:
    """Inverse of :func:`pack_objects`; refuses to unpickle unless ``allow_pickle``."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if _is_marker(x):
                if not allow_pickle:
                    raise InvalidFormat(f"{where}: holds pickled Python objects; load it with "
                                        "allow_pickle=True only if you trust its source")
                return pickle.loads(x[MARKER])
            return {k: walk(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x

    return walk(tree)


def snapshot(tree: Any) -> Any:
    """A copy of ``tree`` sharing nothing mutable with it: tensors copied to CPU, numpy arrays
    (of numbers) copied, dicts, lists and tuples rebuilt (subclasses as the plain type, as the
    skeleton stores them), the immutable leaves of ``_PLAIN`` shared.

    Any other leaf raises :class:`UnsupportedStateType` naming its path and type: it could
    change after the copy was taken. Pickle such leaves first (:func:`pack_objects`), which
    snapshots them too."""

    def copy(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, np.ndarray) and not x.dtype.hasobject:
            return np.array(x, copy=True, order="C", subok=False)
        if isinstance(x, _PLAIN):  # before tuple: torch.Size is one
            return x
        if isinstance(x, dict):
            return {k: copy(v, f"{path}/{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, list):
            return [copy(v, f"{path}/{i}") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return tuple(copy(v, f"{path}/{i}") for i, v in enumerate(x))
        what = ("a numpy array of Python objects" if isinstance(x, np.ndarray)
                else f"a {type(x).__module__}.{type(x).__qualname__}")
        raise UnsupportedStateType(
            f"cannot snapshot {what} at {path!r} for a background write: only tensors, numpy "
            "arrays of numbers, dicts, lists, tuples and plain scalars are copied (with "
            "pickle_fallback=True the rest is pickled at the call)")

    return copy(tree, "")
