"""Lightning ``CheckpointIO`` plugin: compressed checkpoint files that keep Lightning's contract.

    trainer = L.Trainer(plugins=[MithrilCheckpointIO(compression_level=3)], ...)
    ckpt = MithrilCheckpointIO.load("epoch=3-step=400.ckpt")         # the plain dict
    model = load_from_checkpoint(MyModel, "epoch=3-step=400.ckpt")   # Model.load_from_checkpoint

Why a CheckpointIO (not a manager-run): Lightning's ``ModelCheckpoint`` owns file naming,
top-k bookkeeping and deletion by path, so each checkpoint stays one file at exactly the path
Lightning asks for: an MCKP blob holding every tensor of the checkpoint dict (byte grouping +
zstd, lossless) plus the dict's non-tensor skeleton as JSON (no pickle: loading never runs
code).

**The contract** ``ModelCheckpoint`` relies on: once ``save_checkpoint`` returns, a file is at
the path (its ``-vN`` versioning, ``save_last`` and ``save_top_k`` test existence by name), and
a checkpoint that was complete stays complete. By default (``asynchronous=False``) the file is
encoded and written atomically (locked temp file, fsync, rename, folder fsync) before
``save_checkpoint`` returns, exactly as Lightning's own IO: after a SIGKILL at any instant the
folder holds what Lightning's IO would leave, so ``ckpt_path="last"`` resumes from the same
checkpoint. Encoding is about as fast as writing (multi-threaded), which is why this is the
default.

``asynchronous=True`` snapshots the checkpoint (tensors to CPU, numpy arrays copied, other
leaves the skeleton holds are immutable; anything else is refused or, with
``pickle_fallback``, pickled at the call) and returns; encoding and the write run on one
background thread (one write in flight: the next call waits for it). The path is *reserved*
before returning: a new path gets a small reservation file (so existence checks see it; its
writer holds an exclusive ``flock`` on it until the real file is renamed over it), an existing
path keeps its previous complete content until the rename. Any reader waits: our
``load_checkpoint`` joins the pending write, :func:`load_checkpoint_file` in any process
blocks on the reservation's lock, and ``torch.load`` on a reservation fails with a message
naming this module. The departure from the contract, documented in
docs/integrations/lightning.md: a SIGKILL during a background write loses that write
(training went on meanwhile), so ``last.ckpt`` can be older than the newest top-k file, as
with Lightning's own IO killed during that write.
Each write has its own daemon thread, gone when the write is done (no idle pool outlives
``fit``); its ``stop()`` joins it and an ``atexit`` hook joins every pending write, so a write
completes even when nobody called ``teardown``.
Called from a thread other than the main one (Lightning's ``AsyncCheckpointIO`` runs the
wrapped IO on its own executor thread) the write is done on that calling thread: the wrapper's
teardown then joins it, and no thread of ours outlives ``fit``.

**Crash leftovers** are removed at the next start (the first save into or load from a folder):
a temp file or reservation is removed only when no process holds its ``flock`` (the kernel
drops a dead writer's lock, whatever its PID namespace), so a live writer's files are never
touched. On a file system without ``flock`` nothing is removed.

Objects the skeleton cannot express (arbitrary classes in ``hyper_parameters``) raise
``UnsupportedStateType`` at save time, unless ``pickle_fallback=True`` pickles just those
leaves (the tensors stay compressed).

Errors are never swallowed: a failed background write is logged at ERROR level (logger
``mithril_async``) when it fails, so it is seen even if no call follows (a
``trainer.save_checkpoint`` after ``fit``, a process that exits), and raised, as
:class:`~mithril_async.errors.SaveFailed` naming the path, by the next ``save_checkpoint``,
``load_checkpoint``, ``remove_checkpoint``, ``wait`` or ``teardown`` call; a ``teardown``
while another exception propagates (Lightning tears down inside its handler of a failed
``fit``) does not raise it over that exception. Plain
``torch.save`` checkpoints (files that are not MCKP) still load, so switching an existing run
to this plugin is safe.

Loading runs no code unless pickle is allowed: a plain ``torch.save`` file is read with
``torch.load(weights_only=True)`` and pickled leaves stay refused, unless ``allow_pickle``
(the plugin's ``pickle_fallback``, or Lightning's explicit ``weights_only=False``) says the
file is trusted; Lightning's ``weights_only=True`` always wins. A planted ``.ckpt`` is a
pickle, so unpickling it is running its author's code.

Modules: :mod:`.lightning_format` (a checkpoint dict as one MCKP file),
:mod:`.lightning_files` (locked temp files, reservations, cleanup), :mod:`.lightning_writes`
(the background writes) and this one (the plugin, :func:`load_from_checkpoint`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from mithril_async.codec.chunk import CodecParams
from mithril_async.errors import ConfigError, SaveFailed
from mithril_async.integrations._objects import pack_objects, snapshot
from mithril_async.integrations.lightning_files import RESERVED_MAGIC, cleanup_folder, reserve
from mithril_async.integrations.lightning_format import (
    FORMAT_KEY,
    PICKLED_KEY,
    SKELETON_KEY,
    is_ours,
    load_checkpoint_file,
    save_checkpoint_file,
)
from mithril_async.integrations.lightning_writes import (
    LIVE,
    LIVE_LOCK,
    BackgroundWrite,
    WriteThread,
)
from mithril_async.state import flatten_state

try:  # the unified package first, then the standalone one
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    from lightning_fabric.plugins.io.checkpoint_io import (  # type: ignore[assignment]
        CheckpointIO,
    )

__all__ = ["FORMAT_KEY", "PICKLED_KEY", "RESERVED_MAGIC", "SKELETON_KEY", "STORAGE_OPTIONS",
           "MithrilCheckpointIO", "cleanup_folder", "load_checkpoint_file",
           "load_from_checkpoint", "save_checkpoint_file"]

#: what ``save_checkpoint(..., storage_options=...)`` accepts, for this one save:
#: ``compression_level`` (int, zstd level -7..22), ``asynchronous`` (bool: background write
#: or not), ``fsync`` (bool, default True: False skips the fsyncs, for throwaway files)
STORAGE_OPTIONS: dict[str, type] = {"compression_level": int, "asynchronous": bool, "fsync": bool}

_M = TypeVar("_M")


_PATCH_LOCK = threading.Lock()


def load_from_checkpoint(cls: type[_M], path: str | os.PathLike[str], *,
                         allow_pickle: bool = False, **kwargs: Any) -> _M:
    """``cls.load_from_checkpoint(path, **kwargs)`` for our files (and any other).

    Lightning's ``LightningModule.load_from_checkpoint`` reads with ``torch.load`` and offers
    no hook for another format, so this runs it with its file loader answering our files with
    :func:`load_checkpoint_file` for the duration of the call: everything else (hyper-
    parameters, ``hparams_file``, ``strict``, ``map_location``, ``on_load_checkpoint``,
    migration of old checkpoints) is Lightning's own code. Pickled leaves are unpickled only
    with ``allow_pickle=True`` or ``weights_only=False``.
    """
    from lightning.pytorch.core import saving

    original = saving.pl_load

    def pl_load(src: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_ours(src):
            allow = allow_pickle if weights_only is None else not weights_only
            return load_checkpoint_file(src, map_location, allow_pickle=allow)
        return original(src, map_location=map_location, weights_only=weights_only)

    with _PATCH_LOCK:
        saving.pl_load = pl_load  # type: ignore[assignment]
        try:
            return cls.load_from_checkpoint(path, **kwargs)  # type: ignore[attr-defined]
        finally:
            saving.pl_load = original


def _parse_options(options: Any) -> dict[str, Any]:
    """``storage_options`` checked against :data:`STORAGE_OPTIONS` (a typed error otherwise)."""
    if options is None:
        return {}
    known = ", ".join(sorted(STORAGE_OPTIONS))
    if not isinstance(options, Mapping):
        raise ConfigError(f"storage_options must be a dict with keys among {known}, "
                          f"not {type(options).__name__}")
    unknown = sorted(str(k) for k in options if k not in STORAGE_OPTIONS)
    if unknown:
        raise ConfigError(f"storage_options: unknown key(s) {', '.join(unknown)}; "
                          f"MithrilCheckpointIO takes {known}")
    for key, value in options.items():
        want = STORAGE_OPTIONS[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"storage_options[{key!r}] must be {want.__name__}, "
                              f"not {type(value).__name__}")
    return dict(options)


class MithrilCheckpointIO(CheckpointIO):
    """Compressed Lightning checkpoint files (see the module docstring for the contract)."""

    def __init__(self, compression_level: int = 3, *, byte_grouping: bool = True,
                 threads: int | None = None, asynchronous: bool = False,
                 pickle_fallback: bool = False) -> None:
        """``asynchronous=True`` writes on a background thread after reserving the path (see
        the module docstring for what that changes after a crash). ``pickle_fallback=True``
        pickles leaves the skeleton cannot hold, and on load unpickles them (and plain
        ``torch.save`` files) unless Lightning passes ``weights_only=True``. Without it nothing
        is unpickled unless Lightning passes ``weights_only=False`` (the caller saying the
        file is trusted)."""
        super().__init__()
        self.pickle_fallback = pickle_fallback
        self.params = CodecParams(level=compression_level, byte_grouping=byte_grouping)
        self.threads = threads
        self.asynchronous = asynchronous
        self._pending: BackgroundWrite | None = None
        self._swept: set[str] = set()

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def load(path: str | os.PathLike[str], map_location: Any = None, *,
             allow_pickle: bool = False) -> dict[str, Any]:
        """The checkpoint dict of ``path`` (for inference, no Trainer): the one-liner."""
        return load_checkpoint_file(path, map_location, allow_pickle=allow_pickle)

    def _finish_pending(self) -> None:
        """Wait for the in-flight write; raise its error (once) as SaveFailed."""
        write, self._pending = self._pending, None
        if write is None or write.thread is None:
            return
        write.thread.join()
        if write.error is not None:
            raise SaveFailed(f"background checkpoint write to {write.path} failed: "
                             f"{write.error}") from write.error

    def _sweep_once(self, folder: Path) -> None:
        """At the first touch of a folder, remove what killed writers left there."""
        key = os.path.abspath(folder)
        if key not in self._swept:
            self._swept.add(key)
            cleanup_folder(key)

    # ---------------------------------------------------------------- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path``; a file is there when this returns (the
        previous one, or a reservation, until an asynchronous write renames over it).
        ``storage_options``: see :data:`STORAGE_OPTIONS`."""
        opts = _parse_options(storage_options)
        params = self.params if "compression_level" not in opts else CodecParams(
            level=opts["compression_level"], byte_grouping=self.params.byte_grouping)
        durable = opts.get("fsync", True)
        background = (opts.get("asynchronous", self.asynchronous)
                      and threading.current_thread() is threading.main_thread())
        self._finish_pending()
        dst = Path(path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        self._sweep_once(dst.parent)
        if not background:
            save_checkpoint_file(checkpoint, dst, params=params, threads=self.threads,
                                 pickle_fallback=self.pickle_fallback, durable=durable)
            return
        if self.pickle_fallback:  # pickled now: the live objects may change after we return
            checkpoint, _ = pack_objects(checkpoint)
        snap = snapshot(checkpoint)  # every tensor and array copied, or the call refused
        flatten_state(snap)  # unsupported types fail here, on the caller's thread
        write = BackgroundWrite(os.fspath(dst), reserve(os.fspath(dst), durable=durable))
        thread = WriteThread(target=write.run, name="mithril-lightning-write", daemon=True,
                              args=(snap, params, self.threads, self.pickle_fallback, durable))
        with LIVE_LOCK:
            LIVE.add(thread)
        write.thread = thread
        thread.start()
        self._pending = write

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``path``; the caller's ``weights_only`` decides whether anything may be
        unpickled (``None``, Lightning's default: only with ``pickle_fallback``)."""
        self._finish_pending()
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        self._sweep_once(p.parent)
        allow = self.pickle_fallback if weights_only is None else not weights_only
        return load_checkpoint_file(p, map_location, allow_pickle=allow)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` (a folder too, as Lightning's IO does); an in-flight write to it
        is finished first, so it can never re-create the file after the removal."""
        self._finish_pending()
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()

    def wait(self) -> None:
        """Block until the in-flight write is durable; raise its error."""
        self._finish_pending()

    def teardown(self) -> None:
        """Join the in-flight write and raise its error (Lightning calls this at the end of
        ``fit``); called while another exception propagates (Lightning's handler of a failed
        ``fit`` tears down too), the write's failure, logged when it happened, is not raised
        over it."""
        if sys.exc_info()[1] is None:
            self._finish_pending()
            return
        # logged at ERROR by the write itself; the propagating error stays the one seen
        with contextlib.suppress(SaveFailed):
            self._finish_pending()
