"""The ``mithril`` subcommands, one module each: ``add_parser(subparsers)`` + ``run(args)``.

Modules import only the standard library at import time (heavy imports live inside ``run``),
so ``mithril --help`` stays fast. :data:`MODULES` is the order they appear in ``--help``.
"""

from __future__ import annotations

import importlib
from typing import Any

MODULES = ("ls", "inspect", "verify", "restore", "export", "gc", "compress", "decompress",
           "analyze")


def add_all(sub: Any) -> None:
    """Register every subcommand of this package on an argparse subparsers object."""
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
