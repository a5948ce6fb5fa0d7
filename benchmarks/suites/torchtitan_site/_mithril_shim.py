"""Stands in for torchtitan's DCP ``CheckpointManager`` in its own unit tests: the same
constructor, building ``MithrilCheckpointManager`` from the DCP ``Config`` (every field the
two share; saves run in the training process and keep every version torchtitan's
``keep_latest_k`` keeps). Imported by the copy of ``test_checkpoint.py`` that
``run_torchtitan_suite.sh mithril`` makes."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.components.checkpointer.dcp import CheckpointManager as _Dcp

from mithril_async.integrations.torchtitan import MithrilCheckpointManager


class CheckpointManager(MithrilCheckpointManager):
    Config = _Dcp.Config

    def __init__(self, config: Any, **kw: Any) -> None:
        ours = {f.name for f in dataclasses.fields(MithrilCheckpointManager.Config)}
        shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                  if f.name in ours and f.name != "mithril"}
        shared["async_mode"] = str(shared.get("async_mode", "disabled")).lower()
        if shared["async_mode"] == "async_with_pinned_mem":
            shared["async_mode"] = "async"
        cfg = MithrilCheckpointManager.Config(**shared, mithril={"checkpointing": {
            "pipeline": {"process": "inline"}, "compression": {"threads": 1}}})
        super().__init__(cfg, **kw)
