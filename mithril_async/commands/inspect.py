"""``mithril inspect VERSION|FILE``: manifest, tensors, dtypes and compression per tensor.

VERSION is a version folder (``runs/<run>/versions/v000003``), its ``manifest.json``, or a run
folder plus ``--version`` (default ``latest``). FILE is an ``.mckp`` blob or a
``.safetensors`` file. Per tensor it shows dtype, shape, raw and stored bytes, the ratio, the
byte transform and how each plane was entropy-coded, read from the block headers themselves.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from mithril_async.commands._common import (
    human,
    locate,
    print_json,
    ratio,
    resolve_version,
    run_async,
    table,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show a version's manifest and per-tensor compression",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("path", metavar="VERSION|FILE",
                   help="version folder, manifest.json, run folder, .mckp or .safetensors")
    p.add_argument("--version", default=None,
                   help="with a run folder: latest (default), best, v000003 or a step")
    p.add_argument("--no-tensors", action="store_true", help="manifest and blob totals only")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def describe_mckp(data: bytes, where: str) -> dict[str, Any]:
    """Header, metadata and per-tensor compression of an MCKP blob (every block validated)."""
    from mithril_async.codec.chunk import DELTA_BIT, Transform
    from mithril_async.codec.container_read import block_from_bytes, parse_blob
    from mithril_async.codec.entropy import PlaneMethod

    info = parse_blob(data, verify=True)
    mv = memoryview(data)
    tensors = []
    for ti, t in enumerate(info.tensors):
        stored, transforms, planes = 0, Counter[str](), Counter[str]()
        delta = False
        for ci in range(len(t.chunks)):
            ref = info.index[(ti, ci)]
            block, _ = block_from_bytes(mv[ref.offset:ref.offset + ref.length], ref, info)
            stored += ref.length
            delta = delta or bool(block.transform & DELTA_BIT)
            transforms[Transform(block.transform & ~DELTA_BIT).name.lower()] += 1
            for method, _n in block.planes:
                planes[PlaneMethod(method).name.lower()] += 1
        tensors.append({"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                        "raw_bytes": t.nbytes, "bytes": stored,
                        "ratio": ratio(t.nbytes, stored), "chunks": len(t.chunks),
                        "transform": ",".join(sorted(transforms)), "delta": delta,
                        "planes": dict(sorted(planes.items()))})
    meta = {k: v for k, v in info.metadata.items() if k != "mithril.skeleton"}
    return {"file": where, "format": "mckp", "version": info.version, "flags": info.flags,
            "bytes": len(data), "raw_bytes": info.original_size,
            "ratio": ratio(info.original_size, len(data)), "params": info.params,
            "training_step": info.training_step,
            "previous_checkpoint_hash": info.previous_checkpoint_hash,
            "metadata": meta, "tensors": tensors}


async def describe_version(target: Any, run_id: str, version: str | None,
                           with_tensors: bool) -> dict[str, Any]:
    from mithril_async.integrations.safetensors_file import describe_safetensors

    cat = target.catalog(run_id)
    key = await resolve_version(target, run_id, version)
    m = await cat.read_manifest(key)
    doc: dict[str, Any] = {"run_id": run_id, "manifest_key": key,
                           "manifest": m.model_dump(mode="json"), "blobs": [],
                           "held": m.held,
                           "nonfinite": {n: c.model_dump(mode="json") for n, c in
                                         sorted(m.nonfinite_tensors().items())}}
    for ref in m.blobs():
        entry: dict[str, Any] = {"key": ref.key, "format": ref.format, "bytes": ref.bytes,
                                 "raw_bytes": ref.raw_bytes,
                                 "ratio": ratio(ref.raw_bytes, ref.bytes),
                                 "base": ref.base.key if ref.base else None}
        if with_tensors:
            # through the store, as verify and restore read: a blob planted as a symlink (to
            # /etc/passwd, to another run) is refused (UnsafeKey), never followed
            if ref.format == "mckp":
                entry["detail"] = describe_mckp(await cat.store.get(ref.key), ref.key)
            elif ref.format == "safetensors":
                await cat.store.size(ref.key)  # refuses a symlink, like get
                entry["detail"] = describe_safetensors(cat.store.local_path(ref.key))
        doc["blobs"].append(entry)
    return doc


def _print_tensors(tensors: list[dict[str, Any]]) -> None:
    rows = [["TENSOR", "DTYPE", "SHAPE", "RAW", "STORED", "RATIO", "TRANSFORM", "PLANES"]]
    for t in tensors:
        stored = t.get("bytes", 0)
        r = t.get("ratio")
        rows.append([t["name"], str(t["dtype"]), "x".join(map(str, t["shape"])) or "scalar",
                     human(t.get("raw_bytes", stored)), human(stored),
                     f"{r:.2f}x" if r else "-", t.get("transform", "raw"),
                     " ".join(f"{k}:{v}" for k, v in t.get("planes", {}).items())])
    table(rows)


def run(args: argparse.Namespace) -> int:
    from mithril_async.integrations.safetensors_file import describe_safetensors

    target = locate(args.path)
    if target.kind == "file":
        path = Path(target.path)
        data = path.read_bytes()
        doc = (describe_mckp(data, str(path)) if data[:4] == b"MCKP"
               else describe_safetensors(path))
        if args.json:
            print_json(doc)
            return 0
        r = doc.get("ratio")
        print(f"{path}: {doc['format']}, {human(doc['bytes'])}"
              + (f", raw {human(doc['raw_bytes'])}, {r:.2f}x" if r else ""))
        if not args.no_tensors:
            _print_tensors(doc["tensors"])
        return 0
    if target.kind == "runs":
        print("mithril inspect: error: give a run or version folder, not a runs folder "
              "(see `mithril ls`)", file=sys.stderr)
        return 2
    doc = run_async(describe_version(target, target.run_ids[0], args.version,
                                     not args.no_tensors))
    if args.json:
        print_json(doc)
        return 0
    m = doc["manifest"]
    print(f"run {doc['run_id']} {m['version_id']} step {m['step']} "
          f"(world size {m['world_size']}, created {m['created_at'][:19]})")
    print(f"manifest: {doc['manifest_key']}")
    if m["metrics"]:
        print("metrics: " + ", ".join(f"{k}={v}" for k, v in m["metrics"].items()))
    print("compression: " + ", ".join(f"{k}={v}" for k, v in m["compression"].items()))
    if doc["held"]:
        print("HELD: holds NaN/Inf (nonfinite = \"hold\"): latest and best never point here")
    for name, c in doc["nonfinite"].items():
        print(f"non-finite: {name}: {c['nan']} NaN, {c['inf']} Inf"
              + (" (allowed)" if c.get("allowed") else ""))
    for b in doc["blobs"]:
        r = b["ratio"]
        print(f"\n{b['key']} ({b['format']}, {human(b['bytes'])}"
              + (f", raw {human(b['raw_bytes'])}, {r:.2f}x" if r else "")
              + (f", delta against {b['base']}" if b["base"] else "") + ")")
        if "detail" in b:
            _print_tensors(b["detail"]["tensors"])
    return 0
