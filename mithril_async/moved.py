"""Old import paths kept for a release: a module that moved forwards every name to its new
home, with a DeprecationWarning naming both."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["forward_to"]


def forward_to(old: str, new: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``old``, which moved to ``new``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system's own probes (``__path__``, ...)
            raise AttributeError(name)
        warnings.warn(f"{old}.{name} moved to {new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
