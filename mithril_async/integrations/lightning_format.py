"""Checkpoint dicts as single MCKP files, the format of the Lightning plugin (and of the
DeepSpeed one): every tensor compressed losslessly, the dict's non-tensor skeleton as JSON, so
loading runs no code. Leaves the skeleton cannot hold are pickled only with ``pickle_fallback``
and unpickled only with ``allow_pickle``; a plain ``torch.save`` file still loads (with
``weights_only=True`` unless pickle is allowed).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.state_dict import compress_state_dict
from mithril_async.errors import InvalidFormat
from mithril_async.integrations._objects import pack_objects, unpack_objects
from mithril_async.integrations.lightning_files import RESERVED_MAGIC, read_complete, write_file
from mithril_async.restore.reader import read_tree_file
from mithril_async.state import flatten_state, unflatten_state

SKELETON_KEY = "mithril.skeleton"
FORMAT_KEY = "mithril.format"
PICKLED_KEY = "mithril.pickled_leaves"


def encode_checkpoint(checkpoint: dict[str, Any], *, params: CodecParams | None,
                      threads: int | None, pickle_fallback: bool, fmt: str) -> bytes:
    """The bytes of the MCKP file of ``checkpoint``: its tensors, and its skeleton as JSON
    (leaves it cannot hold pickled where ``pickle_fallback``)."""
    pickled = 0
    if pickle_fallback:
        checkpoint, pickled = pack_objects(checkpoint)
    skeleton, tensors = flatten_state(checkpoint)
    return compress_state_dict(tensors, params=params, threads=threads, metadata={
        SKELETON_KEY: json.dumps(skeleton, separators=(",", ":")), FORMAT_KEY: fmt,
        PICKLED_KEY: pickled})


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | os.PathLike[str], *,
                         params: CodecParams | None = None, threads: int | None = None,
                         pickle_fallback: bool = False, fmt: str = "lightning",
                         durable: bool = True) -> int:
    """Write a checkpoint dict as one MCKP file (atomically); return its size.

    ``pickle_fallback``: leaves the JSON skeleton cannot hold are pickled (see
    :mod:`._objects`) instead of raising ``UnsupportedStateType``. ``durable=False`` skips
    the fsyncs (the file is still replaced atomically).
    """
    blob = encode_checkpoint(checkpoint, params=params, threads=threads,
                             pickle_fallback=pickle_fallback, fmt=fmt)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_file(os.fspath(p), blob, durable=durable)
    return len(blob)


def load_checkpoint_file(path: str | os.PathLike[str], map_location: Any = None, *,
                         allow_pickle: bool = False) -> dict[str, Any]:
    """Read what :func:`save_checkpoint_file` wrote (or a plain ``torch.save`` file).

    Nothing is unpickled unless ``allow_pickle``: pickled leaves are refused and a plain
    ``torch.save`` file (a pickle as a whole) is read with ``torch.load(weights_only=True)``,
    which loads tensors and plain containers only. A file that needs more raises
    :class:`InvalidFormat` naming it; pass ``allow_pickle=True`` only for files you trust.
    A file an asynchronous write still fills is waited for.
    """
    p = Path(path)
    data = read_complete(p)
    if data[:4] != b"MCKP":
        try:
            loaded: dict[str, Any] = torch.load(p, map_location=map_location,
                                                weights_only=not allow_pickle)
        except pickle.UnpicklingError as err:
            raise InvalidFormat(f"{p}: a torch.save checkpoint holding Python objects that "
                                "loading would have to unpickle (run code for); load it with "
                                "allow_pickle=True only if you trust its source "
                                f"({str(err).splitlines()[0]})") from None
        return loaded
    meta, tensors = read_tree_file(data, str(p))
    skeleton = meta.get(SKELETON_KEY)
    if not isinstance(skeleton, str):
        raise InvalidFormat(f"{p}: MCKP file without a checkpoint skeleton")
    device = _target_device(map_location)
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    tree: dict[str, Any] = unflatten_state(json.loads(skeleton), tensors)
    if meta.get(PICKLED_KEY):
        tree = unpack_objects(tree, allow_pickle=allow_pickle, where=str(p))
    return tree


def _target_device(map_location: Any) -> torch.device | None:
    """Where decoded (CPU) tensors go, for ``torch.load``-style ``map_location`` values.

    A callable (``lambda storage, loc: storage``) gets the CPU storage and may return it on
    another device; a dict maps ``"cpu"``; a string/device is the device.
    """
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        dev = map_location.get("cpu")
        return None if dev is None else torch.device(dev)
    if callable(map_location):
        moved = map_location(torch.empty(0).untyped_storage(), "cpu")
        dev = getattr(moved, "device", None)
        return None if dev is None or dev == torch.device("cpu") else torch.device(dev)
    raise TypeError(f"map_location of type {type(map_location).__name__} is not supported")


def is_ours(path: Any) -> bool:
    """Whether ``path`` is a local file the plugin wrote (MCKP, or a reservation)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(len(RESERVED_MAGIC))
    except OSError:
        return False
    return head[:4] == b"MCKP" or head == RESERVED_MAGIC
