"""``mithril ls RUNS``: runs, their versions, steps, sizes, compression ratios and aliases;
versions held for NaN/Inf (``nonfinite = "hold"``) say so."""

from __future__ import annotations

import argparse
from typing import Any

from mithril_async.commands._common import (
    Target,
    human,
    locate,
    print_json,
    ratio,
    run_async,
    table,
    version_sizes,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ls", help="list runs, versions, steps, sizes and aliases",
                       description="List every run of a runs folder (or one run) with its "
                       "committed versions: step, stored size, raw size, ratio, aliases.")
    p.add_argument("path", metavar="RUNS", help="a runs folder, or one run's folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


async def collect(target: Target) -> list[dict[str, Any]]:
    """One dict per run: id, aliases and versions (what --json prints)."""
    runs = []
    for run_id in target.run_ids:
        cat = target.catalog(run_id)
        aliases: dict[str, Any] = {}
        for name in ("latest", "best"):
            a = await cat.read_alias(name)
            aliases[name] = None if a is None or a.status != "ok" else a.version_id
        nums = await cat.version_numbers()
        versions: list[dict[str, Any]] = []
        for m in await cat.versions():
            stored, raw = version_sizes(m)
            versions.append({
                "version_id": m.version_id, "step": m.step,
                "created_at": m.created_at.isoformat(), "bytes": stored, "raw_bytes": raw,
                "ratio": ratio(raw, stored), "metrics": m.metrics,
                "world_size": m.world_size,
                "aliases": [n for n, v in aliases.items() if v == m.version_id],
                "held": m.held,
            })
        runs.append({"run_id": run_id, "aliases": aliases, "versions": versions,
                     "unfinished": sorted(n for n, ok in nums.items() if not ok),
                     "bytes": sum(int(v["bytes"]) for v in versions)})
    return runs


def run(args: argparse.Namespace) -> int:
    target = locate(args.path)
    if target.kind in ("file", "version"):
        target.kind = "run"  # ls of a version lists its run
    runs = run_async(collect(target))
    if args.json:
        print_json({"runs_dir": str(target.runs_dir), "runs": runs})
        return 0
    for r in runs:
        print(f"run {r['run_id']}: {len(r['versions'])} version(s), {human(r['bytes'])}"
              + (f", {len(r['unfinished'])} unfinished" if r["unfinished"] else ""))
        rows = [["VERSION", "STEP", "SIZE", "RAW", "RATIO", "ALIASES", "CREATED", "NOTE"]]
        for v in r["versions"]:
            rows.append([v["version_id"], str(v["step"]), human(v["bytes"]),
                         human(v["raw_bytes"]), f"{v['ratio']:.2f}x" if v["ratio"] else "-",
                         ",".join(v["aliases"]), v["created_at"][:19],
                         "held: NaN/Inf" if v["held"] else ""])
        if len(rows) > 1:
            table(rows)
    return 0
