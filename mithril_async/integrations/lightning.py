"""Lightning ``CheckpointIO`` plugin: compressed, asynchronous checkpoint files.

    trainer = L.Trainer(plugins=[MithrilCheckpointIO(compression_level=3)], ...)

Why a CheckpointIO (not a manager-run): Lightning's ``ModelCheckpoint`` owns file naming,
top-k bookkeeping and deletion by path, so each checkpoint stays one file at exactly the path
Lightning asks for: an MCKP blob holding every tensor of the checkpoint dict (byte grouping +
zstd, lossless) plus the dict's non-tensor skeleton as JSON (no pickle: loading never runs
code). ``save_checkpoint`` only snapshots tensors to CPU on the caller's thread and returns;
encoding and the atomic write (temp file, fsync, rename) run on a background thread, one save
in flight at most (the next save waits for it, which bounds memory to one extra copy).

Objects the skeleton cannot express (arbitrary classes in ``hyper_parameters``) raise
``UnsupportedStateType`` at save time, unless ``pickle_fallback=True`` pickles just those
leaves (the tensors stay compressed).

Errors are never swallowed: a failed background write is raised, as
:class:`~mithril_async.errors.SaveFailed` naming the path, by the next ``save_checkpoint``,
``load_checkpoint``, ``remove_checkpoint`` or ``teardown`` call. Loading a path that is still
being written waits for it. Plain ``torch.save`` checkpoints (files that are not MCKP) still
load, so switching an existing run to this plugin is safe.

Loading runs no code unless pickle is allowed: a plain ``torch.save`` file is read with
``torch.load(weights_only=True)`` and pickled leaves stay refused, unless ``allow_pickle``
(the plugin's ``pickle_fallback``, or Lightning's explicit ``weights_only=False``) says the
file is trusted; Lightning's ``weights_only=True`` always wins. A planted ``.ckpt`` is a
pickle, so unpickling it is running its author's code.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.state_dict import compress_state_dict
from mithril_async.errors import InvalidFormat, SaveFailed
from mithril_async.integrations._objects import pack_objects, unpack_objects
from mithril_async.integrations.safetensors_file import atomic_output
from mithril_async.pipeline.reader import read_tree_file
from mithril_async.state import flatten_state, unflatten_state

try:  # the unified package first, then the standalone one
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    from lightning_fabric.plugins.io.checkpoint_io import (  # type: ignore[assignment]
        CheckpointIO,
    )

__all__ = ["MithrilCheckpointIO", "load_checkpoint_file", "save_checkpoint_file"]

SKELETON_KEY = "mithril.skeleton"
FORMAT_KEY = "mithril.format"
PICKLED_KEY = "mithril.pickled_leaves"


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | os.PathLike[str], *,
                         params: CodecParams | None = None, threads: int | None = None,
                         pickle_fallback: bool = False, fmt: str = "lightning") -> int:
    """Write a checkpoint dict as one MCKP file (atomically); return its size.

    ``pickle_fallback``: leaves the JSON skeleton cannot hold are pickled (see
    :mod:`._objects`) instead of raising ``UnsupportedStateType``.
    """
    pickled = 0
    if pickle_fallback:
        checkpoint, pickled = pack_objects(checkpoint)
    skeleton, tensors = flatten_state(checkpoint)
    blob = compress_state_dict(tensors, params=params, threads=threads, metadata={
        SKELETON_KEY: json.dumps(skeleton, separators=(",", ":")), FORMAT_KEY: fmt,
        PICKLED_KEY: pickled})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(p) as f:
        f.write(blob)
    return len(blob)


def load_checkpoint_file(path: str | os.PathLike[str], map_location: Any = None, *,
                         allow_pickle: bool = False) -> dict[str, Any]:
    """Read what :func:`save_checkpoint_file` wrote (or a plain ``torch.save`` file).

    Nothing is unpickled unless ``allow_pickle``: pickled leaves are refused and a plain
    ``torch.save`` file (a pickle as a whole) is read with ``torch.load(weights_only=True)``,
    which loads tensors and plain containers only. A file that needs more raises
    :class:`InvalidFormat` naming it; pass ``allow_pickle=True`` only for files you trust.
    """
    p = Path(path)
    with open(p, "rb") as f:
        data = f.read()
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


class MithrilCheckpointIO(CheckpointIO):
    """Asynchronous, compressed Lightning checkpoint files (see the module docstring)."""

    def __init__(self, compression_level: int = 3, *, byte_grouping: bool = True,
                 threads: int | None = None, asynchronous: bool = True,
                 pickle_fallback: bool = False) -> None:
        """``pickle_fallback=True`` pickles leaves the skeleton cannot hold, and on load
        unpickles them (and plain ``torch.save`` files) unless Lightning passes
        ``weights_only=True``. Without it nothing is unpickled unless Lightning passes
        ``weights_only=False`` (the caller saying the file is trusted)."""
        super().__init__()
        self.pickle_fallback = pickle_fallback
        self.params = CodecParams(level=compression_level, byte_grouping=byte_grouping)
        self.threads = threads
        self.asynchronous = asynchronous
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[str, concurrent.futures.Future[int]] | None = None

    # ---------------------------------------------------------------- background
    def _finish_pending(self) -> None:
        """Wait for the in-flight write; raise its error (once) as SaveFailed."""
        if self._pending is None:
            return
        path, fut = self._pending
        self._pending = None
        try:
            fut.result()
        except BaseException as err:
            raise SaveFailed(f"background checkpoint write to {path} failed: {err}") from err

    def _snapshot(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Copy every tensor to CPU now, so training may change the live ones at once."""

        def copy(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().to("cpu", copy=True)
            if isinstance(x, dict):  # OrderedDict / AttributeDict come back as dict
                return {k: copy(v) for k, v in x.items()}
            if isinstance(x, list):
                return [copy(v) for v in x]
            if isinstance(x, tuple):
                return tuple(copy(v) for v in x)
            return x

        out: dict[str, Any] = copy(checkpoint)
        return out

    # ---------------------------------------------------------------- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MithrilCheckpointIO does not take storage_options")
        self._finish_pending()
        if not self.asynchronous:
            save_checkpoint_file(checkpoint, path, params=self.params, threads=self.threads,
                                 pickle_fallback=self.pickle_fallback)
            return
        snap = self._snapshot(checkpoint)
        if self.pickle_fallback:  # pickle now: the live objects may change after we return
            snap, _ = pack_objects(snap)
        flatten_state(snap)  # unsupported types fail here, on the caller's thread
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "mithril-lightning")
        fut = self._pool.submit(save_checkpoint_file, snap, path, params=self.params,
                                threads=self.threads, pickle_fallback=self.pickle_fallback)
        self._pending = (os.fspath(path), fut)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``path``; the caller's ``weights_only`` decides whether anything may be
        unpickled (``None``, Lightning's default: only with ``pickle_fallback``)."""
        self._finish_pending()
        if not Path(path).exists():
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        allow = self.pickle_fallback if weights_only is None else not weights_only
        return load_checkpoint_file(path, map_location, allow_pickle=allow)

    def remove_checkpoint(self, path: Any) -> None:
        self._finish_pending()
        p = Path(path)
        if p.is_file():
            p.unlink()

    def wait(self) -> None:
        """Block until the in-flight write is durable; raise its error."""
        self._finish_pending()

    def teardown(self) -> None:
        try:
            self._finish_pending()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
