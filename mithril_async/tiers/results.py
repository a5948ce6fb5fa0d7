"""What a save reports about the tiers: :class:`TierResult`, as ``SaveResult.tiers``."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

#: the tiers a version can reach, fastest first
TIERS = ("local", "replicated", "remote")


@dataclass
class TierResult:
    """Which tiers one version reached, and when (seconds after its local commit).

    ``reached["local"]`` is set when the save's handle resolves (the version is committed on
    every node's folder); ``replicated`` and ``remote`` fill in as the background replication
    and upload finish (:meth:`wait`)."""

    version_id: str
    step: int
    committed_at: float
    reached: dict[str, float] = field(default_factory=dict)
    #: tier -> what failed (naming the rank)
    errors: dict[str, str] = field(default_factory=dict)
    #: tier -> the error itself (typed: ``KeyExists`` when the remote already held another
    #: object under one of this version's keys, else ``DistributedError`` naming each rank's)
    failures: dict[str, BaseException] = field(default_factory=dict)
    done: concurrent.futures.Future[None] = field(
        default_factory=concurrent.futures.Future, repr=False)

    def wait(self, timeout: float | None = None) -> TierResult:
        """Block until the background tier work of this version ended (reached or failed)."""
        concurrent.futures.wait([self.done], timeout)
        return self

    def finish(self, fut: concurrent.futures.Future[None]) -> None:
        """The version's background work ``fut`` ended: an error it raised outside any tier
        is recorded under ``background``; :meth:`wait` returns."""
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            self.errors.setdefault("background", repr(exc))
        if not self.done.done():
            self.done.set_result(None)
