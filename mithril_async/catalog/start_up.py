"""What a writer of a run does once when it starts: repair what writers before it left.

A save killed part-way leaves files of an unfinished version (and its claim), and a writer
killed between its manifest and its alias moves leaves ``latest`` / ``best`` behind a committed
version. The first writer of the run to start after that (rank 0 of a job, at its first save
or on entering ``with``) removes the leftovers of writers that are gone, creates the pending
``best`` alias and finishes the alias moves. Live saves of other processes (fresh claims) are
never touched (:mod:`~mithril_async.catalog.claiming`), and a damaged alias is logged, never
a reason not to start.
"""

from __future__ import annotations

import logging

from mithril_async.catalog import RunCatalog
from mithril_async.config import CheckpointingConfig
from mithril_async.errors import InvalidFormat

log = logging.getLogger("mithril_async")


async def maintain_run(catalog: RunCatalog, cfg: CheckpointingConfig,
                       roots: tuple[str | None, str | None]) -> None:
    """Rank 0's start-up repairs of ``catalog``'s run (module docstring); ``roots``: where
    the run's files lie (local folder, remote URL) as ``run.json`` records them."""
    removed = await catalog.clean_unfinished(orphan_age_s=cfg.pipeline.orphan_age_s)
    if removed:
        log.warning("removed leftovers of unfinished saves: %s", ", ".join(removed))
    try:
        await catalog.ensure_best_pending(cfg.best_metric_name, cfg.best_mode)
        # a writer killed between its manifest and its alias moves: finish them now
        if await catalog.repair_aliases(cfg.best_metric_name, cfg.best_mode):
            log.warning("moved aliases to committed versions a killed writer left")
            await catalog.update_run_manifest(*roots)
    except InvalidFormat as err:  # a damaged alias must not stop the manager
        log.warning("could not check the aliases of run %s: %s", catalog.layout.run_id, err)
