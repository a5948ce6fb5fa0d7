"""``mithril export RUN|VERSION --hf OUT_DIR``: a version as a Hugging Face model folder.

Writes what ``save_pretrained`` writes: ``model.safetensors``, or past ``--max-shard-size``
``model-0000k-of-0000N.safetensors`` files and ``model.safetensors.index.json``; and the
``config.json`` / generation config / tokenizer files the run recorded, so
``AutoModel.from_pretrained(OUT_DIR)`` loads it. A multi-rank sharded version (FSDP2 /
DTensor) is consolidated into full tensors one output file at a time. RUN is a run folder
(with ``--version``, default ``latest``), VERSION a version folder or its ``manifest.json``.
Every checksum is verified on the way; an OUT_DIR that is not empty is refused without
``--force``. The export is written beside OUT_DIR and takes its place only once complete, so
a failed export leaves OUT_DIR (and with ``--force`` the previous export in it) intact.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mithril_async.commands._common import (
    human,
    locate,
    print_json,
    progress_bar,
    resolve_version,
    run_async,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a version as a Hugging Face model folder",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("path", metavar="RUN|VERSION", help="run folder or version folder")
    p.add_argument("--hf", required=True, metavar="OUT_DIR",
                   help="the folder to write (Hugging Face's layout)")
    p.add_argument("--version", default=None, help="latest (default), best, v000003 or a step")
    p.add_argument("--item", default="model",
                   help="which stored state to export (default: model)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest weight file, as Hugging Face writes it: 5GB (default), "
                        "500MB, 2GiB, or bytes")
    p.add_argument("--dtype", default=None,
                   help="cast floating-point tensors to this dtype (e.g. bfloat16)")
    p.add_argument("--force", action="store_true",
                   help="replace the export in a folder that is not empty (once the new one "
                        "is complete; its other files are kept)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (and no progress bar)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mithril_async.export.hf import export_hf_async

    target = locate(args.path)
    if target.kind not in ("run", "version"):
        print(f"mithril export: error: {args.path}: give a run folder or a version folder",
              file=sys.stderr)
        return 2
    run_id = target.run_ids[0]

    async def export() -> Any:
        key = await resolve_version(target, run_id, args.version)
        return await export_hf_async(target.catalog(run_id), args.hf, version=key,
                                     item=args.item, max_shard_size=args.max_shard_size,
                                     dtype=args.dtype, force=args.force,
                                     on_progress=bar.update_to if bar.enabled else None)

    with progress_bar(args, "export") as bar:  # tensor bytes written, file by file
        res = run_async(export())
    if args.json:
        print_json(res.to_json())
    elif not args.quiet:
        copied = f", with {', '.join(res.copied)}" if res.copied else \
            " (no config.json recorded: weights only)"
        print(f"exported {res.version_id} (step {res.step}) of {res.run_id} -> {res.out_dir}: "
              f"{len(res.shards)} file(s), {human(res.total_size)}{copied}")
    return 0
