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

from pydantic import BaseModel, ConfigDict, Field

from mithril_async.errors import InvalidFormat, KeyExists, KeyNotFound
from mithril_async.layout import new_run_id
from mithril_async.manifest import SCHEMA_VERSION, parse_model, utcnow
from mithril_async.storage.base import Store, join_key

__all__ = ["CURRENT_RUN_FILE", "CurrentRun", "current_run_key", "resolve_run_id"]

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
