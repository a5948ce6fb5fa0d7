"""The ``mithril`` command.

Each subcommand (ls, inspect, verify, restore, gc, compress, decompress, analyze, ...) is a
module of :mod:`mithril_async.commands` with ``add_parser(subparsers)``, which declares its
arguments and sets ``func``, and ``run(args) -> int``; to add one, write that module and list
it in :data:`mithril_async.commands.MODULES`. :data:`SUBCOMMANDS` registers them (and any
other registration function appended to it). Heavy imports happen inside ``run`` so
``mithril --help`` is fast. Exit codes: 0 ok, 1 a MithrilError / OS error (message on
stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

Subparsers = Any  # argparse's _SubParsersAction is private


def _add_commands(sub: Subparsers) -> None:
    """The subcommands of :mod:`mithril_async.commands`, one module each."""
    from mithril_async.commands import add_all

    add_all(sub)


#: every subcommand's registration function, in ``--help`` order
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_add_commands]


def build_parser() -> argparse.ArgumentParser:
    from mithril_async import __version__

    parser = argparse.ArgumentParser(
        prog="mithril", description="mithril_async: async compressed PyTorch checkpoints"
    )
    parser.add_argument("--version", action="version", version=f"mithril {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mithril`` console script; returns the exit code."""
    from mithril_async.errors import MithrilError

    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (MithrilError, OSError) as e:
        print(f"mithril {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
