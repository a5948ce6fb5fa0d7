"""Which run a manager without ``run_id`` saves into: the runs folder's current run.

A training job restarted with the same configuration must resume where it stopped, without
its user having to invent a run id: a job requeued after a preemption, or the README's loop
run twice, continues the run it started. So a runs folder records its current run in
``<runs>/current_run.json``; a manager whose configuration sets no ``run_id`` reads it and
continues that run (``latest`` resolves to its newest committed version), or, in a folder
that has none yet, starts a new run and records it. Nothing of the earlier run is ever
overwritten: a save of a step the run already committed is refused (``StepAlreadyExists``).

``new_run = true`` starts a fresh run and makes it the folder's current one (the earlier run
stays as it was, under its own id); an explicit ``run_id`` always names its run and neither
reads nor moves the record. Two jobs starting at once in a folder without a record agree on
one run: the record is created with ``put_if_absent`` and the loser takes the winner's.
"""

from __future__ import annotations

import json
from typing import Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from mithril_async.config import CheckpointingConfig
from mithril_async.errors import DistributedError, InvalidFormat, KeyExists, KeyNotFound
from mithril_async.layout import new_run_id
from mithril_async.manifest import SCHEMA_VERSION, parse_model, utcnow
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.save.coordinator import Coordinator
from mithril_async.storage.base import Store, join_key

__all__ = ["CURRENT_RUN_FILE", "CurrentRun", "agree_run_id", "current_run_key", "resolve_run_id"]

#: the file in a runs folder naming its current run (not a valid run id: runs are folders)
CURRENT_RUN_FILE = "current_run.json"
#: the largest record read (a few hundred bytes are written)
MAX_RECORD_BYTES = 64 * 1024


class CurrentRun(BaseModel):
    """``<runs>/current_run.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    started_at: str


def current_run_key(runs_prefix: str) -> str:
    return join_key(runs_prefix, CURRENT_RUN_FILE)


async def resolve_run_id(store: Store, runs_prefix: str, *, new_run: bool) -> tuple[str, bool]:
    """The run id a manager without ``run_id`` uses, and whether it continues an earlier run
    (see the module docstring). A damaged record raises
    :class:`~mithril_async.errors.InvalidFormat` naming it: silently starting over would
    hide the earlier run from the job that meant to resume it."""
    key = current_run_key(runs_prefix)
    if not new_run:
        found = await _read(store, key)
        if found is not None:
            return found, True
    fresh = CurrentRun(run_id=new_run_id(), started_at=utcnow().isoformat())
    body = json.dumps(fresh.model_dump(mode="json")).encode()
    if new_run:
        await store.put(key, body)
        return fresh.run_id, False
    try:
        await store.put_if_absent(key, body)
    except KeyExists:  # another job created it first: both continue that run
        found = await _read(store, key)
        if found is not None:
            return found, True
        raise
    return fresh.run_id, False


async def _read(store: Store, key: str) -> str | None:
    try:
        size = await store.size(key)
        if size > MAX_RECORD_BYTES:
            raise InvalidFormat(f"{key}: a current-run record of {size} bytes is implausibly "
                                f"large (limit {MAX_RECORD_BYTES}); remove it or set run_id")
        data = await store.get(key)
    except KeyNotFound:
        return None
    try:
        return parse_model(CurrentRun, data, key).run_id
    except InvalidFormat as err:
        raise type(err)(f"{err}; remove the file or set run_id / new_run = true") from None


T = TypeVar("T")


@runtime_checkable
class Group(Protocol):
    """The ranks' checkpoint group, as the run id is agreed on it
    (:class:`~mithril_async.distributed.DistCoordinator`)."""

    rank: int

    def broadcast_from_zero(self, value: T, what: str = "broadcast") -> T: ...


def agree_run_id(cfg: CheckpointingConfig, store: Store, runs_prefix: str,
                 coordinator: Coordinator) -> tuple[str, bool]:
    """The run a manager saves into, and whether it continues the runs folder's current run:
    ``run_id``, or rank 0's reading of the current run (a new one where there is none, or
    with ``new_run``) agreed by every rank on ``coordinator``'s group. A failure to read it
    on rank 0 fails on every rank (none waits for the others)."""
    if cfg.run_id is not None:
        return cfg.run_id, False
    group = coordinator if isinstance(coordinator, Group) else None
    rank = coordinator.rank
    if rank != 0 and group is None:
        return new_run_id(), False  # a simulated group without a channel: ids per rank
    found: str | None = None
    continued = False
    failed: Exception | None = None
    if rank == 0:
        loop = BackgroundLoop(name="mithril-run-id")
        try:
            found, continued = loop.run(resolve_run_id(store, runs_prefix,
                                                       new_run=cfg.new_run))
        except Exception as err:
            if group is None:
                raise
            failed = err  # raised once every rank has heard of it: none waits
        finally:
            loop.close()
    if group is not None:
        why = None if failed is None else f"{type(failed).__name__}: {failed}"
        found, why = group.broadcast_from_zero((found, why), "agree_run_id")
        if failed is not None:
            raise failed
        if why is not None:
            raise DistributedError(f"rank 0 could not read the runs folder's current "
                                   f"run: {why}")
    assert found is not None
    return found, continued
