"""``mithril restore PATH --to out.safetensors|out.pt``: a version (or .mckp) to a plain file.

PATH is a run folder (with ``--version``, default ``latest``), a version folder, its
``manifest.json``, or an ``.mckp`` blob. By default the model is written; ``--item all`` writes
every stored state (model, optimizer, ...) as one tree. ``.safetensors`` holds tensors only
(nested names joined with '.'); ``.pt`` keeps the whole tree (plain values included). Every
checksum and delta base is verified on the way; nothing is written on any error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mithril_async.commands._common import (
    ProgressBar,
    Target,
    decompress_total,
    human,
    locate,
    print_json,
    progress_bar,
    refuse_overwrite,
    resolve_version,
    run_async,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("restore", help="write a version as .safetensors or .pt",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("path", metavar="PATH", help="run folder, version folder or .mckp file")
    p.add_argument("--to", required=True, metavar="OUT", help="out.safetensors or out.pt")
    p.add_argument("--version", default=None, help="latest (default), best, v000003 or a step")
    p.add_argument("--item", default="model",
                   help="which stored state to write: model (default), optimizer, ..., or all")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (and no progress bar)")
    p.set_defaults(func=run)


async def read_tree(target: Target, version: str | None, item: str,
                    bar: ProgressBar | None = None) -> tuple[Any, str, int]:
    """(state tree, version id, step) of ``item`` ("all" = every item) of a version; ``bar``
    counts the raw bytes of its blobs as they are decoded."""
    from mithril_async.errors import VersionNotFound
    from mithril_async.restore.reader import VersionReader

    run_id = target.run_ids[0]
    key = await resolve_version(target, run_id, version)
    items = None if item == "all" else {item}
    catalog = target.catalog(run_id)
    with VersionReader(catalog, progress=None if bar is None else bar.callback) as reader:
        if bar is not None and bar.enabled:
            # a reader with no live state decodes every blob of the plan into fresh tensors
            plan = reader.plan(await catalog.read_manifest(key), items=items, rng=False)
            whole = [] if plan.whole_model is None else [plan.whole_model]
            bar.update_to(0, sum(r.raw_bytes for r in [*(b.ref for b in plan.blobs), *whole]))
        got = await reader.read_version(key, items=items, rng=False)
    m, trees = got.manifest, got.trees
    if item != "all" and item not in trees:
        raise VersionNotFound(f"{m.version_id} has no {item!r} state (it has: "
                              f"{', '.join(m.item_names())})")
    return (trees if item == "all" else trees[item]), m.version_id, m.step


def run(args: argparse.Namespace) -> int:
    from mithril_async.integrations.safetensors_file import (
        decompress_file,
        flatten_tensors,
        write_output,
    )

    out = Path(args.to)
    if out.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        print(f"mithril restore: error: --to {out}: use a .safetensors or .pt file",
              file=sys.stderr)
        return 2
    if refuse_overwrite(out, args.force, "restore"):
        return 1
    target = locate(args.path)
    if target.kind == "runs":
        print("mithril restore: error: give a run or version folder, not a runs folder",
              file=sys.stderr)
        return 2
    if target.kind == "file":
        with progress_bar(args, "restore", decompress_total(args, target.path, out)) as bar:
            res = decompress_file(target.path, out, progress=bar.callback)
        doc: dict[str, Any] = {"source": res.src, "to": res.dst, "tensors": res.tensors,
                               "bytes": res.out_bytes}
    else:
        with progress_bar(args, "read") as bar:
            tree, vid, step = run_async(read_tree(target, args.version, args.item, bar))
            if out.suffix == ".safetensors":  # torch.save of a .pt reports nothing
                bar.stage(f"write {out.name}", sum(t.numel() * t.element_size()
                                                  for t in flatten_tensors(tree).values()))
            else:
                bar.close()
            size = write_output(tree, out, progress=bar.callback)
        doc = {"run_id": target.run_ids[0], "version_id": vid, "step": step,
               "item": args.item, "to": str(out), "bytes": size}
    if args.json:
        print_json(doc)
    elif not args.quiet:
        src = doc.get("version_id") or doc.get("source")
        print(f"restored {src} -> {out} ({human(doc['bytes'])})")
    return 0
