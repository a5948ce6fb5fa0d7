"""``mithril decompress FILE.mckp``: back to ``.safetensors`` (default) or ``.pt``.

The output ``.safetensors`` is readable by ``safetensors.safe_open`` and carries the original
file's ``__metadata__``; every block checksum is verified before anything is written. An
existing output is replaced only with ``--force`` (as ``restore`` does).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mithril_async.commands._common import (
    decompress_total,
    human,
    print_json,
    progress_bar,
    refuse_overwrite,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("decompress", help="decompress an .mckp file to .safetensors/.pt",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("src", metavar="FILE", help="an .mckp blob")
    p.add_argument("-o", "--out", default=None,
                   help="output .safetensors or .pt (default: FILE with .safetensors)")
    p.add_argument("--threads", type=int, default=None, help="codec threads (default: all)")
    p.add_argument("--force", action="store_true", help="replace the output if it exists")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (and no progress bar)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mithril_async.integrations.safetensors_file import decompress_file

    out = Path(args.out) if args.out is not None else Path(args.src).with_suffix(".safetensors")
    if refuse_overwrite(out, args.force, "decompress"):
        return 1
    with progress_bar(args, "decompress", decompress_total(args, args.src, out)) as bar:
        res = decompress_file(args.src, out, threads=args.threads, progress=bar.callback)
    if args.json:
        print_json({"source": res.src, "to": res.dst, "tensors": res.tensors,
                    "raw_bytes": res.raw_bytes, "bytes": res.out_bytes})
    elif not args.quiet:
        print(f"{res.src} -> {res.dst}: {res.tensors} tensors, {human(res.out_bytes)}")
    return 0
