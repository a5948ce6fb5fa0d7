"""Watching the processes a worker test starts: whether one still runs, and waiting (with a
hang guard only, never a timing assumption) until one has exited."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie left for its parent to reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def gone(pid: int, deadline_s: float = 120.0) -> bool:
    """Whether process ``pid`` has exited, waited for up to ``deadline_s`` (a hang guard);
    reaped here if it is this process's child."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.01)
    return False
