"""Orbax's ``PyTreeCheckpointHandler`` with our type handlers, its args, and global opt-in.

``MithrilCheckpointHandler`` is Orbax's pytree handler given a type-handler registry where
``jax.Array`` and ``np.ndarray`` leaves go to our handlers; tree metadata, partial restores,
placeholders, transforms, multi-host barriers and the commit protocol stay Orbax's.
``MithrilSave`` / ``MithrilRestore`` are registered with it, so a ``CheckpointManager`` (or a
``Composite`` item) given them needs no handler registry of its own. A ``MithrilRestore`` with a
target tree and no ``restore_args`` restores as ``StandardRestore`` does: each array onto its
target leaf's sharding (any mesh shape or device count), a leaf without one onto the saved
sharding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from orbax.checkpoint._src.handlers import standard_checkpoint_handler as standard
from orbax.checkpoint._src.handlers.pytree_checkpoint_handler import (
    PyTreeCheckpointHandler,
    PyTreeRestoreArgs,
    PyTreeSaveArgs,
)
from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
from orbax.checkpoint._src.serialization import type_handler_registry as registry_lib
from orbax.checkpoint._src.serialization import type_handlers as stock
from orbax.checkpoint._src.serialization import types as ocp_types
from orbax.checkpoint.checkpoint_args import register_with_handler

from mithril_async.integrations.orbax.type_handlers import (
    MithrilArrayHandler,
    MithrilNumpyHandler,
    check_level,
)

__all__ = ["MithrilCheckpointHandler", "MithrilRestore", "MithrilSave", "create_registry",
           "disable_globally", "enable_globally", "restore_args_from_item"]


class _StoredByOrbax:
    """A type no value has: registers a stock handler under its type string only."""


def _never(_: Any) -> bool:
    return False


def create_registry(compression_level: int = 3, *,
                    threads: int | None = None) -> ocp_types.TypeHandlerRegistry:
    """A type-handler registry with Orbax's defaults, except ``jax.Array`` and ``np.ndarray``
    leaves, which go to our handlers. Items saved by Orbax's handlers still load: their
    recorded type strings (``jax.Array``, ``np.ndarray``) stay registered to the stock
    handlers."""
    array = MithrilArrayHandler(compression_level, threads=threads)
    numpy = MithrilNumpyHandler(compression_level, threads=threads)
    reg = registry_lib.create_type_handler_registry(
        (int, stock.ScalarHandler()),
        (float, stock.ScalarHandler()),
        (bytes, stock.ScalarHandler()),
        (np.number, stock.ScalarHandler()),
        (np.ndarray, numpy),
        (jax.Array, array),
        (str, stock.StringHandler()),
        (type(stock.PLACEHOLDER), stock.PlaceholderHandler()),
    )
    reg.add(_StoredByOrbax, array._fallback, func=_never)
    reg.add(_StoredByOrbax, numpy._fallback, func=_never)
    return reg


def restore_args_from_item(item: Any, metadata: Callable[[], Any]) -> Any:
    """Restore arguments for a target tree as ``StandardRestore`` derives them: each leaf's
    own sharding, else the saved one (``metadata``: the checkpoint's tree metadata, read only
    if some leaf has no sharding of its own)."""
    return standard._construct_restore_args(item, metadata, None)


class MithrilCheckpointHandler(PyTreeCheckpointHandler):
    """``PyTreeCheckpointHandler`` storing array leaves with mithril_async's codec.

    ``compression_level``: zstd level of the entropy stage (1-22, default 3); ``threads``:
    coding threads per blob (default: the CPUs this process may use). Every other keyword
    is ``PyTreeCheckpointHandler``'s (``use_ocdbt``, ``multiprocessing_options``, ...; they
    apply to the leaves Orbax's own handlers still write: scalars and strings). The registry
    is this handler's own, so ``type_handler_registry`` is refused."""

    def __init__(self, compression_level: int = 3, *, threads: int | None = None,
                 **kwargs: Any) -> None:
        if "type_handler_registry" in kwargs:
            raise TypeError("MithrilCheckpointHandler builds its own type_handler_registry "
                            "(see mithril_async.integrations.orbax.create_registry)")
        self.compression_level = check_level(compression_level)
        super().__init__(type_handler_registry=create_registry(compression_level,
                                                               threads=threads), **kwargs)

    def restore(self, directory: Any, *args: Any, **kwargs: Any) -> Any:
        """Orbax's restore; a target tree given without ``restore_args`` gets them derived
        from its leaves' shardings, as ``StandardRestore`` does (see the module docstring)."""
        given = kwargs.get("args")
        if (isinstance(given, PyTreeRestoreArgs) and given.item is not None
                and given.restore_args is None):
            derived = restore_args_from_item(given.item, functools.partial(self.metadata,
                                                                           directory))
            kwargs["args"] = dataclasses.replace(given, restore_args=derived)
        return super().restore(directory, *args, **kwargs)


@register_with_handler(MithrilCheckpointHandler, for_save=True)
@dataclasses.dataclass
class MithrilSave(PyTreeSaveArgs):
    """``PyTreeSave`` for :class:`MithrilCheckpointHandler` (same fields)."""


@register_with_handler(MithrilCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class MithrilRestore(PyTreeRestoreArgs):
    """``PyTreeRestore`` for :class:`MithrilCheckpointHandler` (same fields)."""


def enable_globally(compression_level: int = 3, *, threads: int | None = None) -> None:
    """Make our handlers Orbax's global ``jax.Array`` / ``np.ndarray`` type handlers, for code
    that uses ``StandardSave`` / ``PyTreeSave`` with the global registry.

    Handlers read the registry when they are created: call this before creating the
    ``CheckpointManager`` / ``Checkpointer``. Checkpoints saved by Orbax's handlers still load
    (their type strings stay registered to the stock handlers)."""
    registry_lib.register_type_handler(
        jax.Array, MithrilArrayHandler(compression_level, threads=threads), override=True)
    registry_lib.register_type_handler(
        np.ndarray, MithrilNumpyHandler(compression_level, threads=threads), override=True)


def disable_globally() -> None:
    """Give ``jax.Array`` / ``np.ndarray`` back to Orbax's stock handlers. Checkpoints saved
    while enabled then restore through :class:`MithrilCheckpointHandler` (our type strings stay
    registered, so a restore that looks handlers up by the recorded type still finds ours; one
    that asks for ``restore_type=jax.Array`` gets Orbax's handler, which cannot read them)."""
    registry_lib.register_type_handler(
        jax.Array, stock.ArrayHandler(array_metadata_store=array_metadata_store_lib.Store()),
        override=True)
    registry_lib.register_type_handler(np.ndarray, stock.NumpyHandler(), override=True)
