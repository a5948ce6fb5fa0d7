"""The background writes of the Lightning plugin's asynchronous mode: one daemon thread per
write, gone when the write is done (no idle pool outlives ``fit``), joined by ``stop()`` and by an
``atexit`` hook, so a pending write completes even when nobody called ``teardown``. A failed
write is logged when it fails and kept for the plugin's next call to raise; its reservation is
removed, and the reservation's lock is let go in every case so waiting readers go on.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

from mithril_async.codec.chunk import CodecParams
from mithril_async.integrations.lightning_files import same_file, write_file
from mithril_async.integrations.lightning_format import encode_checkpoint
from mithril_async.storage.atomic import unlink_quiet

log = logging.getLogger("mithril_async")


class WriteThread(threading.Thread):
    """The thread of one background write: a daemon (it never keeps an idle process alive)
    whose ``stop()`` waits for its write, and which an ``atexit`` hook joins, so a pending
    write always completes, even when nobody called ``teardown`` / ``wait``."""

    def stop(self) -> None:
        self.join()


LIVE: set[WriteThread] = set()
LIVE_LOCK = threading.Lock()


@atexit.register
def _join_writes_at_exit() -> None:
    with LIVE_LOCK:
        live = list(LIVE)
    for t in live:
        t.join()


class BackgroundWrite:
    """One background write: its thread, its outcome, and the reservation it holds."""

    def __init__(self, path: str, reservation: int | None) -> None:
        self.path = path
        self.reservation = reservation
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self, checkpoint: dict[str, Any], params: CodecParams, threads: int | None,
            pickle_fallback: bool, durable: bool) -> None:
        try:  # packing again is idempotent: it only counts the leaves packed on the caller
            blob = encode_checkpoint(checkpoint, params=params, threads=threads,
                                     pickle_fallback=pickle_fallback, fmt="lightning")
            write_file(self.path, blob, durable=durable)
        except BaseException as err:  # raised by the next call on the training thread
            self.error = err
            log.error("background checkpoint write to %s failed: %s (raised as SaveFailed by "
                      "the plugin's next call)", self.path, err, exc_info=err)
            if self.reservation is not None and same_file(self.reservation, self.path):
                unlink_quiet(self.path)  # never leave a reservation of a failed write
        finally:
            if self.reservation is not None:
                os.close(self.reservation)  # readers waiting on its lock go on
            with LIVE_LOCK:
                LIVE.discard(threading.current_thread())
