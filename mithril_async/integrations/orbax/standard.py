"""Orbax's ``StandardSave`` / ``StandardRestore`` idiom over mithril_async's codec.

``StandardCheckpointHandler`` is how most JAX users save a pytree of arrays: it validates the
tree, and on restore builds each leaf's restore arguments from the target tree (a
``jax.ShapeDtypeStruct`` or array carrying a sharding restores onto that sharding, on any mesh
shape and device count; a leaf without one falls back to the saved sharding). Here that
handler runs with :class:`~mithril_async.integrations.orbax.checkpoint.MithrilCheckpointHandler`
as its pytree implementation, and its args are registered to it, so switching a job over is a
rename::

    ckptr = ocp.Checkpointer(MithrilStandardCheckpointHandler())
    ckptr.save(path, args=MithrilStandardSave(state))
    state = ckptr.restore(path, args=MithrilStandardRestore(abstract_state))

    mngr.save(step, args=MithrilStandardSave(state))      # a CheckpointManager needs no
    mngr.restore(step, args=MithrilStandardRestore(abs))  # handler registry of its own
"""

from __future__ import annotations

import dataclasses
from typing import Any

from orbax.checkpoint._src.handlers import standard_checkpoint_handler as standard
from orbax.checkpoint.checkpoint_args import register_with_handler

from mithril_async.integrations.orbax.checkpoint import MithrilCheckpointHandler

__all__ = ["MithrilStandardCheckpointHandler", "MithrilStandardRestore", "MithrilStandardSave"]


class MithrilStandardCheckpointHandler(standard.StandardCheckpointHandler):
    """Orbax's ``StandardCheckpointHandler`` whose pytree handler is ours.

    ``compression_level`` / ``threads``: as :class:`MithrilCheckpointHandler`; every other
    keyword is ``StandardCheckpointHandler``'s."""

    def __init__(self, compression_level: int = 3, *, threads: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        opts = {k: kwargs[k] for k in ("multiprocessing_options", "pytree_metadata_options",
                                       "use_ocdbt") if k in kwargs}
        self._impl = MithrilCheckpointHandler(
            compression_level, threads=threads,
            save_concurrent_gb=kwargs.get("save_concurrent_gb", 96),
            restore_concurrent_gb=kwargs.get("restore_concurrent_gb", 96), **opts)


@register_with_handler(MithrilStandardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class MithrilStandardSave(standard.StandardSaveArgs):
    """``StandardSave`` for :class:`MithrilStandardCheckpointHandler` (same fields)."""


@register_with_handler(MithrilStandardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class MithrilStandardRestore(standard.StandardRestoreArgs):
    """``StandardRestore`` for :class:`MithrilStandardCheckpointHandler` (same fields): the
    target tree's shardings decide where each array lands."""

