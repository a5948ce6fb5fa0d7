"""Deprecated: moved to :mod:`mithril_async.save.coordinator` (a save's own). Importing a name from
here still works for a release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # the import system's own probes (``__path__``, ...)
        raise AttributeError(name)
    warnings.warn(f"mithril_async.pipeline.coordinator.{name} moved to "
                  "mithril_async.save.coordinator", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("mithril_async.save.coordinator"), name)
