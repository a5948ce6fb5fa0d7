"""A run's committed state as seen through a Store: versions, aliases, run manifest.

:class:`RunCatalog` is the one front door; its parts, one concern each: :mod:`.reads`
(versions, manifests), :mod:`.claiming` (version claims), :mod:`.cleanup`
(what dead writers leave, deleted versions), :mod:`.aliases` (``latest`` / ``best`` by
compare-and-swap, ``run.json``, resolving a target).
"""

from __future__ import annotations

import os

from mithril_async.catalog.aliases import _Aliases
from mithril_async.catalog.reads import check_manifest
from mithril_async.layout import RunLayout

__all__ = ["RunCatalog", "check_manifest", "open_catalog"]


class RunCatalog(_Aliases):
    """Read and commit the metadata of one run in one store."""


def open_catalog(runs_dir: str | os.PathLike[str], run_id: str) -> RunCatalog:
    """The catalog of ``<runs_dir>/<run_id>`` on local disk (keys relative to its parent), for
    tools that read a run without a manager."""
    from pathlib import Path

    from mithril_async.storage.local import LocalStore

    runs = Path(runs_dir).expanduser().absolute()
    return RunCatalog(LocalStore(runs.parent), RunLayout(runs.name, run_id))
