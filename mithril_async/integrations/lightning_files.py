"""Crash-safe checkpoint files for the Lightning plugin: a file is written to a locked temp file,
fsynced and renamed over its path; a path an asynchronous write has claimed holds a small locked
reservation until then; a reader of a reservation waits for its writer's lock.

Every temp file and reservation is held under an exclusive ``flock`` by its writer until the
rename, and the kernel drops the lock when the writer dies (in whatever PID namespace), so
:func:`cleanup_folder` removes only what dead writers left and never a live writer's file. On a
file system without ``flock`` nothing is removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path

from mithril_async.claims import owner_identity
from mithril_async.errors import InvalidFormat
from mithril_async.storage.atomic import fsync_dir, temp_path, unlink_quiet, write_all

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


def try_flock(fd: int, *, shared: bool = False, block: bool = False) -> bool | None:
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


def locked_temp(dst: str) -> tuple[int, str]:
    """Create a temp file beside ``dst`` and hold its exclusive lock for the whole write.

    A cleaner that removed the name between our create and our lock leaves us an unlinked
    inode (``st_nlink == 0``): then a fresh name is taken, so a write never lands nowhere."""
    for _ in range(16):
        tmp = temp_path(dst) + ".lk"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try_flock(fd, block=True)
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not keep a temp file beside {dst}")


def write_file(dst: str, blob: bytes, *, durable: bool = True) -> None:
    """Replace ``dst`` with ``blob`` crash-safely: locked temp, fsync, rename, folder fsync."""
    fd, tmp = locked_temp(dst)
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


def reserve(dst: str, *, durable: bool) -> int | None:
    """Claim a path that does not exist yet with a locked reservation; its fd (lock held) or
    None when something is already there (it keeps its content until our rename)."""
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        return None
    try:
        try_flock(fd)  # a new empty file: nobody else locks it (cleaners skip empty files)
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


def same_file(fd: int, path: str) -> bool:
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
            if try_flock(fd) is True and same_file(fd, entry.path):
                os.unlink(entry.path)  # still holding the lock: no writer can be adopting it
                removed.append(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def read_complete(p: Path) -> bytes:
    """The file's bytes once it is complete: a reservation is waited for (its writer's lock),
    and one whose writer is gone raises :class:`InvalidFormat`."""
    for _ in range(64):
        with open(p, "rb") as f:
            head = f.read(len(RESERVED_MAGIC))
            if head != RESERVED_MAGIC:
                return head + f.read()
            doc = f.read(4096).decode("utf-8", "replace")
            locked = try_flock(f.fileno(), shared=True, block=True)  # waits for a live writer
            if locked and not same_file(f.fileno(), os.fspath(p)):
                continue  # the writer renamed the real file over it: read that
        why = ("its writer died before finishing" if locked else
               "still being written, or its writer died (this file system has no flock to "
               "tell)")
        raise InvalidFormat(
            f"{p}: an unfinished mithril_async checkpoint, {why} (writer: {doc}); it holds no "
            "data: resume from another checkpoint (MithrilCheckpointIO removes such leftovers "
            "at its next start)")
    raise InvalidFormat(f"{p}: replaced over and over while being read")
