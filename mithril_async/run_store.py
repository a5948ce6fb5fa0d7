"""The store a run's configuration names, and the runs folder's key prefix in it.

Opened by the training process's manager and, from the same (already resolved) configuration,
by a checkpoint worker: both must reach the same keys.
"""

from __future__ import annotations

from pathlib import Path

from mithril_async.config import CheckpointingConfig
from mithril_async.storage import open_store
from mithril_async.storage.base import Store
from mithril_async.storage.local import LocalStore
from mithril_async.storage.mirror import MirrorStore

__all__ = ["open_run_store"]


def _open_local(cfg: CheckpointingConfig) -> tuple[Store, str]:
    runs = Path(cfg.runs_path).expanduser().absolute()
    runs.mkdir(parents=True, exist_ok=True)
    return LocalStore(runs.parent), runs.name


def open_run_store(cfg: CheckpointingConfig) -> tuple[Store, str]:
    """The store a config asks for, and the runs folder's key prefix.

    No ``[checkpointing.remote]``: local disk. ``mode = "mirror"``: local disk and the bucket
    (:class:`MirrorStore`). ``mode = "remote_only"``: the bucket alone. Keys are the same
    everywhere: ``<runs folder name>/<run_id>/...`` (under the bucket prefix on S3).
    """
    if cfg.remote is None:
        return _open_local(cfg)
    remote = open_store(cfg.remote)
    if cfg.remote.mode == "remote_only":
        return remote, Path(cfg.runs_path).name or "runs"
    local, prefix = _open_local(cfg)
    return MirrorStore(local, remote), prefix
