"""Peak resident memory sampling for benchmarks (a thread polling RSS every few ms)."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRSS:
    """``with PeakRSS() as p: ...``; ``p.peak_extra`` = max RSS in the block - RSS before."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.proc = psutil.Process()
        self.before = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.before = self.proc.memory_info().rss
        self.peak = self.before
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def peak_extra(self) -> int:
        return self.peak - self.before
