"""What a manager starts that must not outlive it, even when it is dropped without ``close()``.

A manager owns a codec thread pool, its listeners' thread, a background loop and (worker mode)
a checkpoint worker with its shared staging memory. ``close()`` releases them in order; a
manager garbage-collected without it releases them through :func:`let_go` (a
``weakref.finalize`` holds the :class:`Owned` parts, never the manager, so that it can be
collected): the worker finishes the saves it was handed and exits, nothing else stays.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from mithril_async.listeners import ResultListeners
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.pipeline.pool import CodecPool
from mithril_async.worker.client import WorkerClient

__all__ = ["Owned", "let_go"]


@dataclass
class Owned:
    """What a manager starts that would outlive it if it were dropped without ``close()``
    (never the manager itself, so that it can be collected)."""

    pool: CodecPool
    results: ResultListeners
    worker: WorkerClient | None = None
    loop: BackgroundLoop | None = None

    @classmethod
    def watching(cls, manager: object, pool: CodecPool, results: ResultListeners
                 ) -> tuple[Owned, weakref.finalize[[Owned], object]]:
        """The parts ``manager`` owns so far, and their release (:func:`let_go`) should it
        be garbage-collected without ``close()``; not at interpreter exit (the threads end
        then, and the worker sees its trainer end)."""
        owned = cls(pool, results)
        release = weakref.finalize(manager, let_go, owned)
        release.atexit = False
        return owned, release

    def release(self) -> None:
        """The worker finishes the saves it was handed, then exits (not waited for); the
        shared staging memory, the loop, the codec threads and the listeners' are released
        (a save still running here is abandoned, as by ``close(wait=False)``)."""
        if self.worker is not None:
            self.worker.abandon()
            self.worker.arena.close()
        if self.loop is not None:
            self.loop.close()
        self.pool.shutdown(wait=True)
        self.results.close()


def let_go(owned: Owned) -> None:
    """A manager was garbage-collected without ``close()``: release what it owned, on a
    thread of its own (a collection may run on a thread holding one of their locks)."""
    threading.Thread(target=owned.release, name="mithril-release", daemon=True).start()
