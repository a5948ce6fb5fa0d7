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
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import pickle
import re
import shutil
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from mithril_async.claims import owner_identity
from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.state_dict import compress_state_dict
from mithril_async.errors import ConfigError, InvalidFormat, SaveFailed
from mithril_async.integrations._objects import pack_objects, snapshot, unpack_objects
from mithril_async.restore.reader import read_tree_file
from mithril_async.state import flatten_state, unflatten_state
from mithril_async.storage.atomic import fsync_dir, temp_path, unlink_quiet, write_all

try:  # the unified package first, then the standalone one
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    from lightning_fabric.plugins.io.checkpoint_io import (  # type: ignore[assignment]
        CheckpointIO,
    )

__all__ = ["RESERVED_MAGIC", "STORAGE_OPTIONS", "MithrilCheckpointIO", "cleanup_folder",
           "load_checkpoint_file", "load_from_checkpoint", "save_checkpoint_file"]

SKELETON_KEY = "mithril.skeleton"
FORMAT_KEY = "mithril.format"
PICKLED_KEY = "mithril.pickled_leaves"

#: the first bytes of a reservation (a path an asynchronous write has claimed but not yet
#: filled). They are a pickle GLOBAL of a module that cannot exist, so ``torch.load`` fails
#: with this text in its message (and imports nothing) instead of an opaque unpickling error.
RESERVED_MAGIC = (b"\x80\x02cmithril_async: an unfinished checkpoint (its asynchronous write is "
                  b"in progress, or its writer was killed); read it with "
                  b"mithril_async.integrations.lightning.load_checkpoint_file\nreserved\n.")
#: temp files of this module end so (``.tmp-<name>.<pid>.<hex8>.lk``): their writer holds an
#: exclusive ``flock`` on them until the rename, so a free lock proves the writer is gone
_TEMP_RE = re.compile(r"^\.tmp-.+\.\d+\.[0-9a-f]{8}\.lk$")
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}

#: what ``save_checkpoint(..., storage_options=...)`` accepts, for this one save:
#: ``compression_level`` (int, zstd level -7..22), ``asynchronous`` (bool: background write
#: or not), ``fsync`` (bool, default True: False skips the fsyncs, for throwaway files)
STORAGE_OPTIONS: dict[str, type] = {"compression_level": int, "asynchronous": bool, "fsync": bool}

_M = TypeVar("_M")
log = logging.getLogger("mithril_async")


# ------------------------------------------------------------------------ locked files
def _flock(fd: int, *, shared: bool = False, block: bool = False) -> bool | None:
    """Take a ``flock``: True when held, False when another open file holds it, None when the
    file system has no ``flock`` (then nothing can be proven about the file's writer)."""
    op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if block else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in _NO_FLOCK:
            return None
        raise
    return True


def _locked_temp(dst: str) -> tuple[int, str]:
    """Create a temp file beside ``dst`` and hold its exclusive lock for the whole write.

    A cleaner that removed the name between our create and our lock leaves us an unlinked
    inode (``st_nlink == 0``): then a fresh name is taken, so a write never lands nowhere."""
    for _ in range(16):
        tmp = temp_path(dst) + ".lk"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        _flock(fd, block=True)
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not keep a temp file beside {dst}")


def _write_file(dst: str, blob: bytes, *, durable: bool = True) -> None:
    """Replace ``dst`` with ``blob`` crash-safely: locked temp, fsync, rename, folder fsync."""
    fd, tmp = _locked_temp(dst)
    try:
        write_all(fd, blob)
        if durable:
            os.fsync(fd)
        os.rename(tmp, dst)
    except BaseException:
        unlink_quiet(tmp)
        raise
    finally:
        os.close(fd)  # releases the lock, after the rename
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(dst)))


def _reserve(dst: str, *, durable: bool) -> int | None:
    """Claim a path that does not exist yet with a locked reservation; its fd (lock held) or
    None when something is already there (it keeps its content until our rename)."""
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        return None
    try:
        _flock(fd)  # a new empty file: nobody else locks it (cleaners skip empty files)
        doc = {**owner_identity(), "path": os.path.basename(dst)}
        write_all(fd, RESERVED_MAGIC + json.dumps(doc).encode())
        if durable:
            os.fsync(fd)
            fsync_dir(os.path.dirname(os.path.abspath(dst)))
    except BaseException:
        os.close(fd)
        unlink_quiet(dst)
        raise
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def cleanup_folder(folder: str | os.PathLike[str]) -> list[str]:
    """Remove what killed writers of this module left in ``folder``; return the removed paths.

    A temp file (``.tmp-*.lk``) or a reservation is removed only when its ``flock`` can be
    taken, i.e. no process holds it any more: a writer's lock is dropped by the kernel when it
    dies, in whatever PID namespace. A live writer (this process's included) holds it, so its
    files stay; on a file system without ``flock`` nothing is removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if not _TEMP_RE.match(entry.name):
                if entry.stat(follow_symlinks=False).st_size > 4096:
                    continue  # a reservation is a few hundred bytes
                with open(entry.path, "rb") as f:
                    if f.read(len(RESERVED_MAGIC)) != RESERVED_MAGIC:
                        continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # vanished or unreadable: not ours to judge
        try:
            if _flock(fd) is True and _same_file(fd, entry.path):
                os.unlink(entry.path)  # still holding the lock: no writer can be adopting it
                removed.append(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# ------------------------------------------------------------------------ files
def _encode(checkpoint: dict[str, Any], *, params: CodecParams | None, threads: int | None,
            pickle_fallback: bool, fmt: str) -> bytes:
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
    blob = _encode(checkpoint, params=params, threads=threads, pickle_fallback=pickle_fallback,
                   fmt=fmt)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    _write_file(os.fspath(p), blob, durable=durable)
    return len(blob)


def _read_complete(p: Path) -> bytes:
    """The file's bytes once it is complete: a reservation is waited for (its writer's lock),
    and one whose writer is gone raises :class:`InvalidFormat`."""
    for _ in range(64):
        with open(p, "rb") as f:
            head = f.read(len(RESERVED_MAGIC))
            if head != RESERVED_MAGIC:
                return head + f.read()
            doc = f.read(4096).decode("utf-8", "replace")
            locked = _flock(f.fileno(), shared=True, block=True)  # waits for a live writer
            if locked and not _same_file(f.fileno(), os.fspath(p)):
                continue  # the writer renamed the real file over it: read that
        why = ("its writer died before finishing" if locked else
               "still being written, or its writer died (this file system has no flock to "
               "tell)")
        raise InvalidFormat(
            f"{p}: an unfinished mithril_async checkpoint, {why} (writer: {doc}); it holds no "
            "data: resume from another checkpoint (MithrilCheckpointIO removes such leftovers "
            "at its next start)")
    raise InvalidFormat(f"{p}: replaced over and over while being read")


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
    data = _read_complete(p)
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


def _is_ours(path: Any) -> bool:
    """Whether ``path`` is a local file this module wrote (MCKP, or a reservation)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(len(RESERVED_MAGIC))
    except OSError:
        return False
    return head[:4] == b"MCKP" or head == RESERVED_MAGIC


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
        if _is_ours(src):
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


class _WriteThread(threading.Thread):
    """The thread of one background write: a daemon (it never keeps an idle process alive)
    whose ``stop()`` waits for its write, and which an ``atexit`` hook joins, so a pending
    write always completes, even when nobody called ``teardown`` / ``wait``."""

    def stop(self) -> None:
        self.join()


_LIVE: set[_WriteThread] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _join_writes_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for t in live:
        t.join()


class _Write:
    """One background write: its thread, its outcome, and the reservation it holds."""

    def __init__(self, path: str, reservation: int | None) -> None:
        self.path = path
        self.reservation = reservation
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self, checkpoint: dict[str, Any], params: CodecParams, threads: int | None,
            pickle_fallback: bool, durable: bool) -> None:
        try:  # packing again is idempotent: it only counts the leaves packed on the caller
            blob = _encode(checkpoint, params=params, threads=threads,
                           pickle_fallback=pickle_fallback, fmt="lightning")
            _write_file(self.path, blob, durable=durable)
        except BaseException as err:  # raised by the next call on the training thread
            self.error = err
            log.error("background checkpoint write to %s failed: %s (raised as SaveFailed by "
                      "the plugin's next call)", self.path, err, exc_info=err)
            if self.reservation is not None and _same_file(self.reservation, self.path):
                unlink_quiet(self.path)  # never leave a reservation of a failed write
        finally:
            if self.reservation is not None:
                os.close(self.reservation)  # readers waiting on its lock go on
            with _LIVE_LOCK:
                _LIVE.discard(threading.current_thread())


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
        self._pending: _Write | None = None
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
        write = _Write(os.fspath(dst), _reserve(os.fspath(dst), durable=durable))
        thread = _WriteThread(target=write.run, name="mithril-lightning-write", daemon=True,
                              args=(snap, params, self.threads, self.pickle_fallback, durable))
        with _LIVE_LOCK:
            _LIVE.add(thread)
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
