"""The compare-and-swap lock of a :class:`~mithril_async.storage.local.LocalStore`.

``put_if_match`` renames under an ``flock`` on ``<root>/.tmp-cas.lock``, which excludes other
``put_if_match`` callers in this and other processes on the same machine. The lock file is
created 0600 (whoever can open it can take the lock) and never followed through a symlink. The
wait is bounded: ``flock`` itself cannot time out, so it is tried non-blocking with a growing
pause, and a holder that never lets go fails the write with
:class:`~mithril_async.errors.LockTimeout` instead of hanging it and every later save.

The file is opened through the store's file system module (``fs``, the store's ``os``), the one
name the fault and power-loss tests replace.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import time
from collections.abc import Iterator
from types import ModuleType

from mithril_async.errors import LockTimeout
from mithril_async.storage.base import RESERVED_PREFIX

LOCK_NAME = RESERVED_PREFIX + "cas.lock"
#: permissions of the lock file (and of a store's private files)
PRIVATE_MODE = 0o600
#: how long ``put_if_match`` waits for the compare-and-swap lock by default, and the longest
#: pause between two tries (polling with backoff: ``flock`` itself cannot time out)
LOCK_TIMEOUT_S = 60.0
_LOCK_MAX_PAUSE_S = 0.1


@contextlib.contextmanager
def cas_lock(fs: ModuleType, root: str, timeout_s: float, url: str) -> Iterator[None]:
    """Hold the compare-and-swap lock of the store at ``root`` (an ``flock`` on
    ``.tmp-cas.lock``).

    The file is created 0600 and never followed through a symlink: whoever can open it
    can take the lock, so only the store's owner may. A lock file left group- or
    world-accessible by an older version is tightened when it is ours."""
    path = fs.path.join(root, LOCK_NAME)
    fd = fs.open(path, fs.O_RDWR | fs.O_CREAT | fs.O_CLOEXEC | fs.O_NOFOLLOW, PRIVATE_MODE)
    try:
        st = fs.fstat(fd)
        if st.st_mode & 0o077 and st.st_uid == fs.geteuid():
            fs.fchmod(fd, PRIVATE_MODE)
        _flock_within(fd, path, timeout_s, url)
        yield
    finally:
        fs.close(fd)  # closing the descriptor releases the flock


def _flock_within(fd: int, path: str, timeout_s: float, url: str) -> None:
    """``flock`` ``fd`` exclusively within ``timeout_s`` (non-blocking tries with a growing
    pause), else :class:`LockTimeout`: a holder that never lets go must fail the write that
    waits for it, not hang it and every later save."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeout(errno.ETIMEDOUT, f"the lock {path} of {url} stayed held "
                              f"by another process for {timeout_s:g} s", path)
        time.sleep(min(pause, left))
        pause = min(pause * 2, _LOCK_MAX_PAUSE_S)
