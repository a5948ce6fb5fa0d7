"""Orbax's ``PyTreeCheckpointHandlerTest``, every test, with its ``ocdbt_checkpoint_handler``
(the handler nearly every test saves and restores with) building a
:class:`MithrilCheckpointHandler` with the same options. Tests that construct
``PyTreeCheckpointHandler()`` themselves still use Orbax's handler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytree_checkpoint_handler_test as orbax_tests
from orbax.checkpoint import test_utils
from orbax.checkpoint._src.metadata import tree as tree_metadata
from orbax.checkpoint._src.multihost import multihost

from mithril_async.integrations.orbax import MithrilCheckpointHandler


class FinalizingMithrilCheckpointHandler(MithrilCheckpointHandler):
    """``save`` also finalizes, as Orbax's test variant ``test_utils.PyTreeCheckpointHandler``
    of its own handler does (a Checkpointer would)."""

    def save(self, directory: Any, *args: Any, **kwargs: Any) -> None:
        super().save(directory, *args, **kwargs)
        test_utils.sync_global_processes("PyTreeCheckpointHandler:save")
        if multihost.process_index() == 0:
            self.finalize(directory)
        test_utils.sync_global_processes("PyTreeCheckpointHandler:finalize")


class MithrilPyTreeCheckpointHandlerTest(orbax_tests.PyTreeCheckpointHandlerTest):
    @contextlib.contextmanager
    def ocdbt_checkpoint_handler(
        self, use_ocdbt: bool, use_zarr3: bool = False,
        enable_pinned_host_transfer: bool | None = None,
        pytree_metadata_options: tree_metadata.PyTreeMetadataOptions = (
            tree_metadata.PYTREE_METADATA_OPTIONS),
        array_metadata_store: Any = None,  # Orbax's per-array metadata: our index holds it
        use_compression: bool = True,
    ) -> Iterator[MithrilCheckpointHandler]:
        del array_metadata_store
        handler = FinalizingMithrilCheckpointHandler(
            use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
            pytree_metadata_options=pytree_metadata_options,
            enable_pinned_host_transfer=enable_pinned_host_transfer,
            use_compression=use_compression)
        try:
            yield handler
        finally:
            handler.close()
