"""The files of a version as the tier layer moves them: who wrote each, which a restore reads.

Replication and upload move the files each rank wrote (:func:`owned_files`). A recovery
fetches the files the one reader will read for this rank: the keys of its restore plan
(:meth:`~mithril_async.restore.plan.RestorePlan.keys`, the same plan the reader makes, for
every case: same layout, pieces, another world size), plus the run's config file, which the
next save records (:func:`files_to_restore`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from mithril_async.manifest import VersionManifest
from mithril_async.restore.plan import RestorePlan

log = logging.getLogger("mithril_async")

_RANK_IN_KEY = re.compile(r"_rank(\d{4})\.[^/]*$")

#: the restore plan of a version for this rank (the manager's reader's, no I/O)
Planner = Callable[[VersionManifest], RestorePlan]


@dataclass(frozen=True)
class Need:
    """One file of a version: its key, the rank that wrote it, size and XXH64 when known."""

    key: str
    owner: int
    bytes: int | None
    xxh64: str | None


def owner_of(key: str) -> int:
    """The rank that wrote a blob (``..._rankNNNN.ext``; the whole model is rank 0's)."""
    m = _RANK_IN_KEY.search(key)
    return int(m.group(1)) if m else 0


def config_file(m: VersionManifest) -> Need | None:
    """The run's recorded config file (rank 0 writes it), if the version names one."""
    return None if m.config is None else Need(m.config.key, 0, m.config.bytes, m.config.xxh64)


def owned_files(m: VersionManifest) -> dict[int, list[Need]]:
    """Every file of a version by the rank that wrote it (blobs and RNG files)."""
    out: dict[int, list[Need]] = {}
    seen: set[str] = set()
    for b in m.blobs():
        if b.key in seen:
            continue
        seen.add(b.key)
        o = owner_of(b.key)
        out.setdefault(o, []).append(Need(b.key, o, b.bytes, b.xxh64))
    for k in m.rng.keys:
        out.setdefault(k.rank, []).append(Need(k.key, k.rank, None, k.xxh64))
    return out


def every_file(m: VersionManifest) -> dict[str, Need]:
    """Every file of a version by key: its blobs, RNG files and the run's config file."""
    out = {n.key: n for files in owned_files(m).values() for n in files}
    conf = config_file(m)
    if conf is not None:
        out.setdefault(conf.key, conf)
    return out


def files_to_restore(m: VersionManifest, plan: Planner | None) -> list[Need]:
    """What this rank's restore of ``m`` reads (its plan's keys) and the run's config file.

    Every file of the version when no plan is given or it cannot be made here (a version the
    live state cannot take: the reader refuses it with its own, clear error; until then the
    recovery fetches what any plan could read)."""
    index = every_file(m)
    if plan is None:
        return list(index.values())
    try:
        keys = plan(m).keys()
    except Exception as err:
        log.debug("tiers: no restore plan for %s here (%r); every file of it is fetched",
                  m.version_id, err)
        return list(index.values())
    conf = config_file(m)
    out = [conf] if conf is not None else []
    out += [index.get(k) or Need(k, owner_of(k), None, None) for k in keys]
    return list({n.key: n for n in out}.values())


def intact(data: bytes | memoryview | None, need: Need) -> bool:
    """``data`` is the file ``need`` names: its size and XXH64 where the manifest has them."""
    if data is None:
        return False
    if need.bytes is not None and len(data) != need.bytes:
        return False
    return need.xxh64 is None or xxhash.xxh64_hexdigest(data) == need.xxh64
