"""JAX / Orbax: mithril_async's codec inside Orbax's own checkpointing.

Usage::

    import orbax.checkpoint as ocp
    from mithril_async.integrations.orbax import (
        MithrilCheckpointHandler, MithrilRestore, MithrilSave)

    ckptr = ocp.Checkpointer(MithrilCheckpointHandler(compression_level=3))
    ckptr.save(path, args=MithrilSave(state))
    state = ckptr.restore(path, args=MithrilRestore(abstract_state))

    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(step, args=MithrilSave(state))         # async: returns after the host copy

Modules: ``layout`` (the files and their index, no JAX), ``blobs`` (writing and ranged
reading of blobs), ``arrays`` (host copies of shards, building target shardings),
``type_handlers`` (the Orbax type handlers), ``checkpoint`` (the pytree handler, its args,
``enable_globally``), ``standard`` (the ``StandardSave`` / ``StandardRestore`` drop-in).
Importing this package imports neither JAX nor Orbax; the names below do, on first use
(``pip install mithril_async[orbax]``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MithrilArrayHandler",
    "MithrilCheckpointHandler",
    "MithrilNumpyHandler",
    "MithrilRestore",
    "MithrilSave",
    "MithrilStandardCheckpointHandler",
    "MithrilStandardRestore",
    "MithrilStandardSave",
    "create_registry",
    "disable_globally",
    "enable_globally",
]

_WHERE = {
    "MithrilArrayHandler": "type_handlers",
    "MithrilNumpyHandler": "type_handlers",
    "MithrilCheckpointHandler": "checkpoint",
    "MithrilRestore": "checkpoint",
    "MithrilSave": "checkpoint",
    "MithrilStandardCheckpointHandler": "standard",
    "MithrilStandardRestore": "standard",
    "MithrilStandardSave": "standard",
    "create_registry": "checkpoint",
    "disable_globally": "checkpoint",
    "enable_globally": "checkpoint",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:
        raise ImportError(f"{name} needs JAX and orbax-checkpoint ({e}); install them with "
                          "`pip install mithril_async[orbax]`") from e
    return getattr(mod, name)
