"""A restore from the run into the live state: read (plan and execute), then apply.

:class:`LiveRestore` is the manager's restore. It reads a version through the one
:class:`~mithril_async.restore.reader.VersionReader` (which plans with the live state's
targets, below) and applies what it decoded: each item's ``load_state_dict`` (or nothing, where
every tensor was decoded straight into its own), the resharded items' ``load_resharded``, the
JSON states and data-loader states (``on_reshard`` on another world size), the RNG; then what
saves hand on and the live state no longer matches (delta chains, the worker's, the lossy
chain's reconstruction) is reset. What ``restore()`` returns: a :class:`RestoreResult`, the
step carrying a :class:`ResumeReport`.

A version whose state the live one cannot take is refused before anything is written: plain
entries are all checked first (:class:`~mithril_async.plain_state.PlainEntry`); a fallback
over a partially overwritten state that then fails to load is
:class:`~mithril_async.errors.RestoreIncomplete`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mithril_async.config import CheckpointingConfig
from mithril_async.errors import RestoreIncomplete, VersionNotFound
from mithril_async.layout import RunLayout
from mithril_async.live import LiveState
from mithril_async.restore.reader import DecodedVersion, VersionReader
from mithril_async.restore.targets import loaded_in_place
from mithril_async.state import default_on_reshard, reseed_rng, restore_rng

log = logging.getLogger("mithril_async")

#: ``on_reshard(states_by_rank, new_rank, new_world) -> state``: a data-loader state for this
#: rank from every saved rank's (restores on another world size)
OnReshard = Callable[[dict[int, Any], int, int], Any]


@dataclass(frozen=True)
class ResumeReport:
    """How a restore continues the run."""

    #: the run continues bit-identically (the version's ``resume.exact``, and no reshard)
    exact: bool
    #: the version was restored on another world size or mesh
    resharded: bool = False
    saved_world_size: int = 1
    world_size: int = 1
    #: what was remapped or reseeded instead of restored
    notes: tuple[str, ...] = ()


class RestoreResult(int):
    """What ``restore()`` returns: the restored step (an ``int``) carrying ``resume``, a
    :class:`ResumeReport` (``result.resume.exact``)."""

    resume: ResumeReport

    def __new__(cls, step: int, resume: ResumeReport) -> RestoreResult:
        obj = super().__new__(cls, step)
        obj.resume = resume
        return obj

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        """Pickled (``torch.save`` of a loop's state) as the plain step it is."""
        return int, (int(self),)


class Resettable(Protocol):
    def reset(self) -> None: ...


class SavesHandOn(Protocol):
    """What saves hand on from one to the next, which a restore invalidates
    (:class:`~mithril_async.save.context.SaveContext`)."""

    @property
    def chains(self) -> Mapping[str, Resettable]: ...

    @property
    def lossy(self) -> Resettable | None: ...

    @property
    def steps(self) -> set[int] | None: ...


class CopyGuard(Protocol):
    """An overlapped snapshot's copy still reading the live tensors
    (:class:`~mithril_async.save.overlap.StepGuard`)."""

    def wait(self) -> None: ...


class WorkerChains(Protocol):
    def reset_chains(self) -> None: ...


class LiveRestore:
    """The restore of one manager's live ``state`` (module docstring). ``guard``: the
    overlapped snapshot's guard once the manager has one (None: none); ``worker``: its
    checkpoint worker (None: saves run inline)."""

    def __init__(self, state: LiveState, cfg: CheckpointingConfig,
                 reader: VersionReader, layout: RunLayout, *, rank: int, world_size: int,
                 saves: SavesHandOn, guard: Callable[[], CopyGuard | None],
                 worker: WorkerChains | None) -> None:
        self.state = state
        self.cfg = cfg
        self.reader = reader
        self.layout = layout
        self.rank, self.world_size = rank, world_size
        self.saves = saves
        self._guard = guard
        self.worker = worker

    async def read(self, target: str | int, fallback: bool, load: str,
                   verify: str | None = None) -> DecodedVersion:
        """Plan and execute the restore of ``target`` (on the background loop): tensors go
        straight into the live ones where they can, the rest is decoded for :meth:`apply`.
        Per-rank RNG and data states are not read for a model-only load."""
        guard = self._guard()
        if guard is not None:  # a copy still reading the live tensors finishes first
            await asyncio.get_running_loop().run_in_executor(None, guard.wait)
        return await self.reader.read_version(
            target, rank=self.rank, world_size=self.world_size, fallback=fallback,
            items={"model"} if load == "model" else None, rng=load != "model",
            live=self,
            verify=verify or self.cfg.restore.verify)

    @property
    def has_json_states(self) -> bool:
        """Some item is a data-loader state (a reshard maps every saved rank's)."""
        return self.state.has_json_states

    def _restored(self, item: str) -> bool:
        return item != "optimizer" or self.cfg.resume_optimizer

    def in_place_targets(self, item: str) -> Mapping[str, Any] | None:
        """The live tensors of ``item`` to decode straight into
        (:meth:`LiveState.in_place_targets`), for an item this restore loads."""
        return self.state.in_place_targets(item) if self._restored(item) else None

    def reshard_targets(self, item: str, pieces: dict[str, Any]) -> dict[str, Any] | None:
        """Where a restore from pieces writes ``item`` on this rank (sharded items only),
        for an item this restore loads."""
        return self.state.reshard_targets(item, pieces) if self._restored(item) else None

    def apply(self, decoded: DecodedVersion, load: str,
              on_reshard: OnReshard = default_on_reshard) -> RestoreResult:
        """Load what :meth:`read` decoded into the live state."""
        if decoded.after_partial is None:
            return self._load(decoded, load, on_reshard)
        # a fallback over a partially overwritten state: the live state is this version's
        # only once every item is loaded, so a failure on the way is RestoreIncomplete
        try:
            return self._load(decoded, load, on_reshard)
        except Exception as err:
            raise RestoreIncomplete(
                f"restore fell back to {decoded.manifest.version_id} after the newer version "
                f"failed with the live state partially overwritten ({decoded.after_partial}), "
                f"and loading it failed: the live state is partially overwritten; cause: "
                f"{type(err).__name__}: {err}") from err

    def _load(self, decoded: DecodedVersion, load: str,
              on_reshard: OnReshard) -> RestoreResult:
        m = decoded.manifest
        guard = self._guard()
        if guard is not None:  # a copy still reading the live tensors finishes first
            guard.wait()
        for name, b in self.state.bindings.items():  # plain entries: checked before writes
            if b.kind == "plain" and name in decoded.trees and (load == "all" or name == "model"):
                b.obj.check(decoded.trees[name])
        notes = self._load_items(decoded, load, on_reshard)
        resharded = decoded.rng_by_rank is not None
        if load == "all":
            notes += self._load_rng(decoded)
        self._hand_on_nothing(m.step)
        report = ResumeReport(exact=m.resume.exact and not resharded, resharded=resharded,
                              saved_world_size=m.world_size, world_size=self.world_size,
                              notes=tuple(notes))
        if resharded:
            log.warning("restored %s (saved by %d rank(s)) on %d rank(s): not an exact "
                        "resume (%s)", m.version_id, m.world_size, self.world_size,
                        "; ".join(notes) or "sharded state remapped")
        return RestoreResult(m.step, report)

    def _load_items(self, decoded: DecodedVersion, load: str,
                    on_reshard: OnReshard) -> list[str]:
        """Each item the load takes, into its live object; what was remapped, as notes."""
        m, trees, rng_doc = decoded.manifest, decoded.trees, decoded.rng
        by_rank = decoded.rng_by_rank
        notes: list[str] = []
        for name, b in self.state.bindings.items():
            obj = b.obj
            if load == "model" and name != "model":
                continue
            if not self._restored(name):
                continue
            if name in decoded.from_pieces:
                obj.load_resharded(trees[name])
            elif b.stateful:
                if name not in trees:
                    raise VersionNotFound(f"{m.version_id} has no state for {name!r}")
                if name in decoded.in_place and b.kind == "module" \
                        and loaded_in_place(obj, trees[name]):
                    continue  # every tensor was decoded into the module's own: nothing to load
                obj.load_state_dict(trees[name])
            elif by_rank is not None and load == "all":
                states = {r: d["states"][name] for r, d in by_rank.items()
                          if name in d.get("states", {})}
                if states:
                    obj.set_state(on_reshard(states, self.rank, self.world_size))
                    notes.append(f"{name}: mapped from {len(states)} saved rank(s)")
            elif name in rng_doc.get("states", {}):
                obj.set_state(rng_doc["states"][name])
        return notes

    def _load_rng(self, decoded: DecodedVersion) -> list[str]:
        """This rank's RNG: the saved one, or on a rank the save did not have a
        deterministic reseed (said in the notes)."""
        by_rank = decoded.rng_by_rank
        if by_rank is None:
            restore_rng(decoded.rng["rng"])
            return []
        if self.rank in by_rank:
            restore_rng(by_rank[self.rank]["rng"])
            return []
        lowest = by_rank[min(by_rank)]["rng"]
        return [f"rng: rank {self.rank} did not exist; reseeded "
                f"{reseed_rng(lowest, self.rank)}"]

    def _hand_on_nothing(self, step: int) -> None:
        """The live state is the restored version's now: no staged base, worker chain or
        lossy reconstruction matches it; its step is among the run's."""
        for chain in self.saves.chains.values():
            chain.reset()
        if self.worker is not None:
            self.worker.reset_chains()
        if self.saves.lossy is not None:
            self.saves.lossy.reset()
        if self.saves.steps is not None:
            self.saves.steps.add(step)
