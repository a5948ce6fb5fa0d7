"""Key names of a run's layout (docs/LAYOUT.md), in one place.

Keys are relative to the store root, which is the parent of ``runs_path``; the first key
component is the runs folder's name (``runs/<run_id>/versions/v000001/manifest.json``), so the
same keys work as local paths and as S3 object keys under a prefix.

A version's per-rank files (shards, RNG files, lossy blobs) sit in the version folder for
ranks 0-15 and, from rank 16 on, in a folder per group of :data:`RANKS_PER_FOLDER` ranks
inside it (``v000001/ranks0016/opt_shard_rank0017.bin``): S3 limits the writes per second of
one prefix, and a folder per 16 ranks keeps a busy job's write rate per prefix under that
limit (docs/BENCHMARKS.md). Readers take every key from the manifest, so a version with every
file in the version folder reads the same.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from mithril_async.manifest import version_id
from mithril_async.storage.base import check_key, join_key

#: ranks whose files share one folder of a version (one S3 prefix; see the module docstring)
RANKS_PER_FOLDER = 16


def new_run_id() -> str:
    """A fresh, sortable, collision-resistant run id (new runs get new ids, so nothing is
    ever overwritten)."""
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


@dataclass(frozen=True)
class RunLayout:
    runs_prefix: str
    run_id: str

    def __post_init__(self) -> None:
        check_key(self.runs_prefix)
        check_key(self.run_id)

    @property
    def root(self) -> str:
        return join_key(self.runs_prefix, self.run_id)

    def config_key(self, name: str) -> str:
        return join_key(self.root, "config", name)

    def alias_key(self, name: str) -> str:
        return join_key(self.root, "aliases", f"{name}.json")

    @property
    def run_manifest_key(self) -> str:
        return join_key(self.root, "run.json")

    @property
    def versions_prefix(self) -> str:
        return join_key(self.root, "versions") + "/"

    def version_dir(self, number: int) -> str:
        return join_key(self.root, "versions", version_id(number))

    def manifest_key(self, number: int) -> str:
        return join_key(self.version_dir(number), "manifest.json")

    def claim_key(self, number: int) -> str:
        return join_key(self.version_dir(number), "_claim.json")

    def model_key(self, number: int, ext: str) -> str:
        return join_key(self.version_dir(number), f"model.{ext}")

    def rank_dir(self, number: int, rank: int) -> str:
        """The folder of ``rank``'s files in version ``number``: the version folder for
        the first :data:`RANKS_PER_FOLDER` ranks, ``ranksNNNN`` (its group's first rank)
        inside it for the others."""
        first = rank - rank % RANKS_PER_FOLDER
        if first == 0:
            return self.version_dir(number)
        return join_key(self.version_dir(number), f"ranks{first:04d}")

    def shard_key(self, number: int, kind: str, rank: int) -> str:
        stem = "opt_shard" if kind == "optimizer" else f"{kind}_shard"
        return join_key(self.rank_dir(number, rank), f"{stem}_rank{rank:04d}.bin")

    def lossy_key(self, number: int, rank: int) -> str:
        return join_key(self.rank_dir(number, rank), f"lossy_rank{rank:04d}.mldc")

    def rng_key(self, number: int, rank: int) -> str:
        return join_key(self.rank_dir(number, rank), f"rng_rank{rank:04d}.json")

    def owns(self, key: str) -> bool:
        """Whether ``key`` lies inside this run (manifests must not point elsewhere)."""
        return key.startswith(self.root + "/")
