"""Orbax's ``StandardCheckpointHandlerTestBase`` and ``StandardCheckpointHandlerTestJaxRandomKeys``,
every test, with the standard handler's pytree implementation replaced by
:class:`MithrilCheckpointHandler`.

``StandardCheckpointHandler`` keeps its own ``StandardSave`` / ``StandardRestore`` args (it
validates the tree and builds restore args from targets and metadata, then calls its
pytree handler): here those args are registered to a subclass whose pytree handler is ours.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import standard_checkpoint_handler_test as orbax_tests
from orbax.checkpoint._src.handlers import standard_checkpoint_handler as standard
from orbax.checkpoint._src.handlers import standard_checkpoint_handler_test_utils as test_utils
from orbax.checkpoint.checkpoint_args import register_with_handler

from mithril_async.integrations.orbax import MithrilCheckpointHandler


class MithrilStandardCheckpointHandler(test_utils.StandardCheckpointHandler):
    """Orbax's standard handler over :class:`MithrilCheckpointHandler` (the tests' variant of
    the standard handler: ``save`` also finalizes, as a Checkpointer would)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        opts = {k: kwargs[k] for k in ("multiprocessing_options", "pytree_metadata_options",
                                       "use_ocdbt") if k in kwargs}
        self._impl = MithrilCheckpointHandler(
            save_concurrent_gb=kwargs.get("save_concurrent_gb", 96),
            restore_concurrent_gb=kwargs.get("restore_concurrent_gb", 96), **opts)


@register_with_handler(MithrilStandardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class MithrilStandardSave(standard.StandardSaveArgs):
    pass


@register_with_handler(MithrilStandardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class MithrilStandardRestore(standard.StandardRestoreArgs):
    pass


class MithrilStandardCheckpointHandlerTest(orbax_tests.StandardCheckpointHandlerTestBase):
    save_args_cls = MithrilStandardSave
    restore_args_cls = MithrilStandardRestore

    @property
    def handler(self) -> MithrilStandardCheckpointHandler:
        return MithrilStandardCheckpointHandler()


class MithrilStandardCheckpointHandlerTestJaxRandomKeys(
        orbax_tests.StandardCheckpointHandlerTestJaxRandomKeys):
    save_args_cls = MithrilStandardSave
    restore_args_cls = MithrilStandardRestore

    @property
    def handler(self) -> MithrilStandardCheckpointHandler:
        return MithrilStandardCheckpointHandler()
