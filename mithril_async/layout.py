"""Key names of the seed-002 layout, in one place.

Keys are relative to the store root, which is the parent of ``runs_path``; the first key
component is the runs folder's name (``runs/<run_id>/versions/v000001/manifest.json``), so the
same keys work as local paths and as S3 object keys under a prefix.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from mithril_async.manifest import version_id
from mithril_async.storage.base import check_key, join_key


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

    def shard_key(self, number: int, kind: str, rank: int) -> str:
        stem = "opt_shard" if kind == "optimizer" else f"{kind}_shard"
        return join_key(self.version_dir(number), f"{stem}_rank{rank:04d}.bin")

    def lossy_key(self, number: int, rank: int) -> str:
        return join_key(self.version_dir(number), f"lossy_rank{rank:04d}.mldc")

    def rng_key(self, number: int, rank: int) -> str:
        return join_key(self.version_dir(number), f"rng_rank{rank:04d}.json")

    def owns(self, key: str) -> bool:
        """Whether ``key`` lies inside this run (manifests must not point elsewhere)."""
        return key.startswith(self.root + "/")
