"""Opt-in pickling of the leaves a state skeleton cannot express (framework checkpoints).

The library stores state trees as tensors + a JSON skeleton and never pickles, so loading never
runs code. Framework checkpoints (Lightning ``hyper_parameters``, DeepSpeed's loss scaler and
config objects) hold arbitrary Python objects that the frameworks themselves pickle. These two
functions let an integration keep the tensors compressed and pickle *only* the leaves the
skeleton cannot hold, each replaced by a one-key marker dict; unpickling happens only when the
caller allows it, otherwise loading fails with a clear error.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from mithril_async.errors import InvalidFormat

__all__ = ["MARKER", "pack_objects", "unpack_objects"]

MARKER = "__mithril_pickle__"
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
