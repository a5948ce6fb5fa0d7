"""Replace an output folder only once its replacement is complete.

An export (:mod:`~mithril_async.export.hf`) never writes into the folder it replaces: it
writes a fresh sibling, ``.<name>.export-<pid>.<random>`` (same folder, so same file system),
and only once every file of it is written and synced does the sibling take the folder's
name (:func:`swap_in`):

* On Linux, one ``renameat2(RENAME_EXCHANGE)`` swaps the two folders atomically: at every
  instant the name holds the whole previous export or the whole new one. The previous one,
  now under the sibling's name, is then deleted.
* Where that exchange is missing (another OS, a file system without it), the previous folder
  is renamed aside (``.<name>.previous-<pid>.<random>``), the new one renamed in, then the
  previous one deleted. A crash between the two renames leaves the name missing but both
  folders complete beside it: rename the ``.previous-`` one back (or the ``.export-`` one in).

A failure before the swap deletes the sibling (:func:`discard`) and leaves the previous
folder as it was, whatever the failure; an export killed before it leaves its ``.export-``
sibling behind (never removed by a later export, which cannot tell it from a live one on
another host sharing the folder): delete it. Entries of the previous folder that the new one
does not write themselves (a README, training arguments, subfolders) are carried over
(:func:`new_sibling`) as hard links (copies where a link fails), so replacing an export
keeps them, as writing into the folder did. The price: room for both exports at once.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from mithril_async.storage.atomic import fsync_dir

__all__ = ["discard", "new_sibling", "swap_in"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name[:100]}.{kind}-{os.getpid()}.{secrets.token_hex(4)}"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry(src: os.DirEntry[str], dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src.path), dst)
    elif src.is_dir():
        shutil.copytree(src.path, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src.path, str(dst))


def new_sibling(target: Path, carry: Callable[[str], bool]) -> Path:
    """A fresh, empty-but-for-what-is-carried folder beside ``target`` (its parents made as
    needed) to write the replacement into; the entries of an existing ``target`` whose name
    ``carry`` accepts are carried into it, and it gets ``target``'s permissions."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = _sibling(target, "export")
    work.mkdir()
    try:
        if target.is_dir():
            shutil.copymode(target, work)
            with os.scandir(target) as entries:
                for entry in entries:
                    if carry(entry.name):
                        _carry(entry, work / entry.name)
    except BaseException:
        discard(work)
        raise
    return work


def discard(work: Path) -> None:
    """Delete a replacement that will not be used (a failed export)."""
    shutil.rmtree(work, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux ``renameat2``); False where this
    system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:  # a C library older than glibc 2.28
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(work: Path, target: Path, *, exchange: bool = True) -> None:
    """Give the complete folder ``work`` the name ``target`` (see the module docstring);
    ``exchange=False``: by the two renames even where the atomic exchange exists."""
    parent = str(target.parent)
    if not os.path.lexists(target):
        os.rename(work, target)
        fsync_dir(parent)
        return
    if exchange and _exchange(work, target):
        fsync_dir(parent)
        discard(work)  # the previous folder, now under the sibling's name
        return
    aside = _sibling(target, "previous")
    os.rename(target, aside)
    try:
        os.rename(work, target)
    except BaseException:
        os.rename(aside, target)
        raise
    fsync_dir(parent)
    discard(aside)
