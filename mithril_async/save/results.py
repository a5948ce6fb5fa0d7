"""What a save reports: timings, sizes and throughput, for callbacks, logs and the demo table."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class SaveResult:
    """One save, as the training loop and the logs see it."""

    step: int
    status: Literal["committed", "skipped", "failed", "pending"] = "pending"
    version_id: str | None = None
    #: seconds ``save()`` blocked the caller (snapshot copy, plus any wait for a busy pipeline)
    stall_s: float = 0.0
    #: seconds spent waiting for the previous save (part of ``stall_s``; on_busy = "wait")
    waited_s: float = 0.0
    #: seconds ``optimizer.step()`` waited for this save's overlapped copy (snapshot =
    #: "overlapped"): the loop was blocked ``stall_s + step_wait_s`` in all
    step_wait_s: float = 0.0
    #: seconds from the call to the commit of manifest and aliases
    total_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    error: str | None = None
    #: the most host memory the pipeline held during this save, by its own account
    #: (staging buffers or slot ring, codec scratch and encoded chunks until written, write
    #: buffers); never above ``[checkpointing.pipeline] host_memory_mib`` when that is set
    host_peak_bytes: int = 0
    #: the state did not fit the budget staged and streamed through the slot ring (a keyframe)
    streamed: bool = False
    #: with ``[checkpointing.tiers]``: which tiers this version reached and when
    #: (``reached``: tier -> seconds after the local commit), filled in as the background
    #: replication and upload finish (``tiers.wait()`` blocks until they did), and what
    #: failed (``errors``); None without tiers or for a save that did not commit. A
    #: :class:`~mithril_async.tiers.results.TierResult`, typed Any here: the pipeline does not
    #: import the tier layer built on it (tests/test_layering.py)
    tiers: Any = None
    #: the non-finite guard: tensors of this version (every rank's) holding NaN or Inf that
    #: ``nonfinite_allow`` does not allow, ``"<item>/<tensor>"`` -> (NaNs, Infs); empty when
    #: none did
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: committed but held (``nonfinite = "hold"``): ``latest`` and ``best`` did not move to it
    held: bool = False

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0

    @property
    def mb_s(self) -> float:
        """Throughput of the whole save in MB/s of raw state."""
        return self.bytes_in / 1e6 / self.total_s if self.total_s > 0 else 0.0

    def line(self) -> str:
        return (f"step {self.step:>7} {self.status:<9} {self.version_id or '-':>8} "
                f"stall {(self.stall_s + self.step_wait_s) * 1e3:8.1f} ms  "
                f"total {self.total_s:7.3f} s  "
                f"{self.bytes_in / 1e6:9.2f} MB -> {self.bytes_out / 1e6:9.2f} MB  "
                f"ratio {self.ratio:5.2f}x  {self.mb_s:8.1f} MB/s"
                + ("  held: NaN/Inf" if self.held else ""))


@dataclass
class SaveHandle:
    """Returned by ``save()``: the snapshot is done; ``result()`` waits for the commit."""

    result_obj: SaveResult
    future: concurrent.futures.Future[SaveResult] | None = field(default=None, repr=False)
    #: ``result()`` raised the save's error: the caller has seen it (``close()`` then does
    #: not raise it again)
    error_seen: bool = field(default=False, repr=False)

    @property
    def skipped(self) -> bool:
        return self.result_obj.status == "skipped"

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Block until the background part finished; raise its error if it failed."""
        if self.future is None:
            return self.result_obj
        try:
            return self.future.result(timeout)
        except BaseException:
            self.error_seen = self.future.done()  # not a timeout of this wait
            raise
