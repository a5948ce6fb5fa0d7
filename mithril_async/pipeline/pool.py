"""The codec thread pool: a thread pool that says how many threads it has.

Transforms, entropy coding, hashing and restores' window decodes run on it (native code,
GIL released). Callers size their work by its thread count (windows in flight, lanes of a
streamed save, the chunks a decode splits), so the pool states it as ``threads``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

__all__ = ["CodecPool"]


class CodecPool(concurrent.futures.ThreadPoolExecutor):
    """A :class:`~concurrent.futures.ThreadPoolExecutor` of ``threads`` threads."""

    def __init__(self, threads: int, name: str = "mithril-codec",
                 initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        self._size = max(1, int(threads))
        super().__init__(self._size, name, initializer=initializer, initargs=initargs)

    @property
    def threads(self) -> int:
        """How many threads run the pool's work."""
        return self._size
