"""``[checkpointing.tiers]``: where the node-local tier lives and how many peer copies a save makes.

:class:`TiersConfig` is the type of :attr:`~mithril_async.config.CheckpointingConfig.tiers`: a
strict pydantic model like the rest of the configuration, validated when the TOML is parsed, so
every problem is a :class:`~mithril_async.errors.ConfigError` naming the key. It lives with the
tier layer that owns its options, and imports nothing of it.

``local`` is the node-local root under which the runs folder lives (NVMe, or ``/dev/shm`` for
RAM). ``{node}`` and ``{rank}`` are replaced per process, which is also how tests simulate
several nodes on one machine. The folder that holds the first templated component (or the path
itself, without placeholders) must exist: a typo in a mount point must fail at construction,
not silently create a folder on the root disk.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mithril_async.errors import ConfigError

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_KNOWN = {"node", "rank"}


class TiersConfig(BaseModel):
    """The ``[checkpointing.tiers]`` table."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: node-local root; ``{node}`` / ``{rank}`` are replaced
    local: str = Field(min_length=1)
    #: copies of each rank's encoded blobs on other nodes (0: none)
    replicas: int = Field(1, ge=0, le=16)
    #: versions kept on the node-local tier and on the replica tier (None: all)
    keep_local: int | None = Field(2, ge=1)
    keep_replicated: int | None = Field(2, ge=1)
    #: every collective and transfer of the tier layer is bounded by this (seconds)
    commit_timeout_s: float = Field(300.0, gt=0)
    #: upload every committed version to ``[checkpointing.remote]`` in the background
    upload: bool = True

    @field_validator("local")
    @classmethod
    def _known_placeholders(cls, v: str) -> str:
        bad = [n for n in _PLACEHOLDER.findall(v) if n not in _KNOWN]
        if bad:
            raise ValueError(f"{v!r}: unknown placeholder(s) "
                             f"{', '.join('{' + b + '}' for b in bad)}; only {{node}} and "
                             "{rank} are replaced")
        return v

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], *, where: str = "checkpointing.tiers"
                     ) -> TiersConfig:
        """Validate the raw table; errors name ``<where>.<key>``."""
        try:
            return cls.model_validate(dict(table))
        except ValidationError as err:
            parts = []
            for e in err.errors():
                loc = ".".join(str(x) for x in e["loc"])
                parts.append(f"{where}.{loc}: {e['msg']}")
            raise ConfigError("; ".join(parts)) from None

    def local_path(self, node: int, rank: int) -> Path:
        """The templated node-local root of one process."""
        return Path(self.local.replace("{node}", str(node)).replace("{rank}", str(rank))
                    ).expanduser().absolute()

    def anchor(self) -> Path:
        """The folder that must already exist: the parent of the first templated component
        (or the path itself when nothing is templated)."""
        path = Path(self.local).expanduser().absolute()
        for i, part in enumerate(path.parts):
            if _PLACEHOLDER.search(part):
                return Path(*path.parts[:i])
        return path


def check_local_root(cfg: TiersConfig, node: int, rank: int) -> Path:
    """Create (if needed) and probe this process's local root; ConfigError names what fails."""
    anchor = cfg.anchor()
    if not anchor.is_dir():
        raise ConfigError(f"checkpointing.tiers.local = {cfg.local!r}: {anchor} "
                          f"{'is not a directory' if anchor.exists() else 'does not exist'}"
                          " (the node-local tier's mount point must exist)")
    root = cfg.local_path(node, rank)
    probe = root / f".mithril-probe-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"checkpointing.tiers.local = {cfg.local!r}: {root} is not "
                          f"writable ({type(err).__name__}: {err.strerror or err})") from None
    return root
