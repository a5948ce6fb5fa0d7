"""``mithril compress FILE``: a ``.safetensors`` (or ``.pt`` state dict) to an ``.mckp`` blob.

Lossless: ``mithril decompress`` gives back the same tensors (names, dtypes, shapes, bytes)
and the safetensors ``__metadata__``.
"""

from __future__ import annotations

import argparse
from typing import Any

from mithril_async.commands._common import human, print_json, progress_bar, shows_progress


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compress", help="compress a .safetensors/.pt file to .mckp",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("src", metavar="FILE", help="model.safetensors or a .pt state dict")
    p.add_argument("-o", "--out", default=None, help="output (default: FILE with .mckp)")
    p.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    p.add_argument("--threads", type=int, default=None, help="codec threads (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (and no progress bar)")
    p.set_defaults(func=run)


def _raw_bytes(src: str) -> int | None:
    """The tensor bytes of a ``.safetensors`` file, from its header (the bar's total); None
    for a ``.pt`` (known only once loaded) or a file that does not parse (``compress_file``
    then says why)."""
    from mithril_async.errors import MithrilError
    from mithril_async.integrations.safetensors_file import describe_safetensors

    if not src.endswith(".safetensors"):
        return None
    try:
        return sum(int(t["bytes"]) for t in describe_safetensors(src)["tensors"])
    except (MithrilError, OSError, ValueError, TypeError):
        return None


def run(args: argparse.Namespace) -> int:
    from mithril_async.integrations.safetensors_file import compress_file

    with progress_bar(args, "compress", _raw_bytes(args.src) if shows_progress(args) else None
                      ) as bar:
        res = compress_file(args.src, args.out, level=args.level, threads=args.threads,
                            progress=bar.callback)
    if args.json:
        print_json({"source": res.src, "to": res.dst, "tensors": res.tensors,
                    "raw_bytes": res.raw_bytes, "bytes": res.out_bytes,
                    "ratio": round(res.ratio, 4)})
    elif not args.quiet:
        print(f"{res.src} -> {res.dst}: {res.tensors} tensors, {human(res.raw_bytes)} -> "
              f"{human(res.out_bytes)} ({res.ratio:.3f}x)")
    return 0
