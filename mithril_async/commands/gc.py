"""``mithril gc PATH [--dry-run]``: remove what no committed version needs.

Removed: folders of unfinished saves whose writer is gone (no manifest, stale claim — a live
save's fresh claim is never touched), files inside committed version folders that their
manifest does not name, and leftover temp files. With ``--keep-last``/``--keep-best``/
``--keep-every`` also whole versions, by the library's retention planner: alias targets and
every delta base of a kept version are always kept. ``--dry-run`` lists what would go and how
many bytes that frees, and changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mithril_async.commands._common import Target, human, locate, print_json, run_async, table


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gc", help="delete unfinished saves, orphan files, old versions",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("path", metavar="RUNS", help="a runs folder or one run's folder")
    p.add_argument("--dry-run", "-n", action="store_true", help="show, change nothing")
    p.add_argument("--keep-last", type=int, default=None, metavar="N")
    p.add_argument("--keep-best", type=int, default=None, metavar="N")
    p.add_argument("--metric", default=None, help="metric of --keep-best")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="of --keep-best")
    p.add_argument("--keep-every", type=int, default=None, metavar="STEPS")
    p.add_argument("--stale-hours", type=float, default=6.0,
                   help="an unfinished save from another host is abandoned after this long")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


async def _size(store: Any, key: str) -> int:
    try:
        return int(await store.size(key))
    except Exception:
        return 0


async def plan_run(target: Target, run_id: str, args: argparse.Namespace
                   ) -> list[dict[str, Any]]:
    """What gc would delete in one run: [{kind, what, keys, bytes}]."""
    from mithril_async.manifest import version_number
    from mithril_async.retention import from_options, plan_deletions

    if args.keep_best and not args.metric:
        raise ValueError("--keep-best needs --metric")
    cat = target.catalog(run_id)
    store, lay = cat.store, cat.layout
    out: list[dict[str, Any]] = []
    nums = await cat.version_numbers()
    for n, committed in sorted(nums.items()):
        keys = await store.list(lay.version_dir(n) + "/")
        if not committed:
            if await cat.claim_is_stale(n, args.stale_hours * 3600):
                out.append({"kind": "unfinished", "what": lay.version_dir(n), "keys": keys})
            continue
        m = await cat.read_manifest(lay.manifest_key(n))
        named = set(m.all_keys()) | {lay.manifest_key(n), lay.claim_key(n)}
        orphans = [k for k in keys if k not in named]
        if orphans:
            out.append({"kind": "orphan", "what": lay.version_dir(n), "keys": orphans})
    policy = from_options(keep_last=args.keep_last, keep_best=args.keep_best,
                          metric=args.metric, mode=args.mode,
                          keep_every_n_steps=args.keep_every)
    for v in await plan_deletions(cat, policy):
        keys = await store.list(lay.version_dir(version_number(v.version_id)) + "/")
        out.append({"kind": "retention", "what": v.version_id, "keys": keys})
    for item in out:
        item["bytes"] = sum([await _size(store, k) for k in item["keys"]])
    return out


async def apply_run(target: Target, run_id: str, plan: list[dict[str, Any]]) -> None:
    cat = target.catalog(run_id)
    for item in plan:
        if item["kind"] == "retention":
            await cat.delete_version(item["what"])
        else:
            for key in item["keys"]:
                await cat.store.delete(key)
    await cat.store.cleanup_incomplete(cat.layout.root + "/")
    if any(i["kind"] == "retention" for i in plan):
        root = getattr(cat.store, "root", None)
        await cat.update_run_manifest(None if root is None else str(root), None)


async def gc(target: Target, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    plans = {}
    for run_id in target.run_ids:
        plans[run_id] = await plan_run(target, run_id, args)
        if not args.dry_run:
            await apply_run(target, run_id, plans[run_id])
    return plans


def run(args: argparse.Namespace) -> int:
    target = locate(args.path)
    if target.kind in ("file", "version"):
        print("mithril gc: error: give a runs folder or a run folder", file=sys.stderr)
        return 2
    try:
        plans = run_async(gc(target, args))
    except ValueError as err:
        print(f"mithril gc: error: {err}", file=sys.stderr)
        return 2
    total = sum(i["bytes"] for p in plans.values() for i in p)
    if args.json:
        print_json({"dry_run": args.dry_run, "bytes": total, "runs": plans})
        return 0
    rows = [["RUN", "KIND", "WHAT", "FILES", "SIZE"]]
    for run_id, plan in plans.items():
        rows += [[run_id, i["kind"], i["what"], str(len(i["keys"])), human(i["bytes"])]
                 for i in plan]
    if len(rows) > 1:
        table(rows)
    verb = "would free" if args.dry_run else "freed"
    print(f"{verb} {human(total)} in {sum(len(p) for p in plans.values())} item(s)")
    return 0
