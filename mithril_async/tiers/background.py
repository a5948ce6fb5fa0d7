"""The tier work that follows a local commit, in the background, one version after the other.

Each committed version gets one job on the tier layer's own loop, queued behind the previous
one, so replication (:mod:`~mithril_async.tiers.replicate`) and upload
(:mod:`~mithril_async.tiers.upload`) run in the same order on every rank (their collectives pair
up) and never hold up a save; then per-tier retention. Jobs a recovery queues (writing fetched
copies back into the node folder) take their place in the same queue. A failed tier is
recorded in the version's :class:`~mithril_async.tiers.results.TierResult`, naming the rank; it
never touches the local commit.

Retention per tier: the node lead keeps ``keep_local`` versions in its node folder and
``keep_replicated`` in its replica folder (the remote follows the config's ``keep_*``, at
upload). The newest version complete on the remote is never deleted from a fast tier while no
newer version is complete where a node loss cannot take it (the replica tier or the remote):
while uploads and replication fail, the fast tiers keep the last durable recovery point. And
no version is deleted from the node folder before its replication and upload ran: they copy it
from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from mithril_async.catalog import RunCatalog
from mithril_async.manifest import VersionManifest
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.tiers.commit import VersionMeta
from mithril_async.tiers.context import TierContext
from mithril_async.tiers.replicate import replicate
from mithril_async.tiers.results import TierResult
from mithril_async.tiers.upload import upload

log = logging.getLogger("mithril_async")


class Background:
    """The queue of background tier jobs of one process, and what they found."""

    def __init__(self, ctx: TierContext, loop: BackgroundLoop) -> None:
        self.ctx = ctx
        self.loop = loop
        #: version id -> what that version reached
        self.results: dict[str, TierResult] = {}
        self._last: concurrent.futures.Future[None] | None = None
        self._queueing = threading.Lock()
        #: newest versions this process saw complete on the remote / replica tier
        self.newest_remote: str | None = None
        self.newest_replicated: str | None = None
        #: versions committed on the node folder whose replication and upload have not run
        #: yet: retention leaves them there (they are copied from there)
        self.pending: set[str] = set()
        #: the run's config files this process put on the remote
        self.configs_uploaded: set[str] = set()

    def committed(self, meta: VersionMeta, m: VersionManifest) -> TierResult:
        """A version just committed on the node folder: queue its replication and upload."""
        self.pending.add(m.version_id)
        res = TierResult(m.version_id, m.step, time.time())
        res.reached["local"] = 0.0
        self.results[m.version_id] = res
        fut = self.queue(lambda: self._version(meta, m, res))
        fut.add_done_callback(res.finish)
        return res

    def queue(self, job: Callable[[], Awaitable[None]]) -> concurrent.futures.Future[None]:
        """Run ``job()`` on the tier loop once every job queued before it ended."""
        with self._queueing:  # a worker's answer queues from the channel's thread
            prev = self._last

            async def after() -> None:
                if prev is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.wrap_future(prev)
                await job()

            self._last = fut = self.loop.submit(after())
        return fut

    def wait(self, timeout: float | None = None) -> list[TierResult]:
        """Wait for every job queued so far; every version's result."""
        if self._last is not None:
            concurrent.futures.wait([self._last], timeout)
        return list(self.results.values())

    async def _version(self, meta: VersionMeta, m: VersionManifest, res: TierResult) -> None:
        ctx = self.ctx
        if ctx.tcfg.replicas:
            try:
                await replicate(ctx, meta, m)
                res.reached["replicated"] = time.time() - res.committed_at
                self.newest_replicated = m.version_id
            except Exception as err:
                res.errors["replicated"], res.failures["replicated"] = str(err), err
                log.error("%s did not reach the replica tier: %s", m.version_id, err)
        if ctx.remote is not None:
            try:
                await upload(ctx, meta, m, self.configs_uploaded)
                res.reached["remote"] = time.time() - res.committed_at
                self.newest_remote = m.version_id
            except Exception as err:
                res.errors["remote"], res.failures["remote"] = str(err), err
                log.error("%s did not reach the remote tier: %s", m.version_id, err)
        self.pending.discard(m.version_id)  # every slower tier has had its copy
        try:
            await self.retention()
        except Exception as err:  # the versions are committed; retried after the next save
            log.warning("tier retention after %s failed: %r", m.version_id, err)

    async def retention(self) -> None:
        """Node lead: each fast tier down to its ``keep_*`` (module docstring)."""
        ctx = self.ctx
        if not ctx.lead or ctx.layout is None:
            return
        for store, keep, node in ((ctx.store, ctx.tcfg.keep_local, True),
                                  (ctx.replica, ctx.tcfg.keep_replicated, False)):
            if keep is None:
                continue
            cat = RunCatalog(store, ctx.layout)
            numbers = await cat.version_numbers()
            committed = sorted(f"v{n:06d}" for n, ok in numbers.items() if ok)
            doomed = committed[:-keep] if len(committed) > keep else []
            nr, rep = self.newest_remote, self.newest_replicated
            if nr is not None and (rep is None or rep <= nr):
                doomed = [v for v in doomed if v != nr]
            if node:
                doomed = [v for v in doomed if v not in self.pending]
            for vid in reversed(doomed):  # newest first, like the manager's retention
                await cat.delete_version(vid)
