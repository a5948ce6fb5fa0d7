"""``mithril gc PATH [--dry-run]``: remove what no committed version needs.

Removed: folders of unfinished saves whose writer is gone (no manifest, and a claim whose
heartbeat stopped more than --claim-stale seconds ago, or whose writer is provably dead),
files inside committed version folders that their manifest does not name, and temp files /
multipart uploads older than --orphan-age. With ``--keep-last``/``--keep-best``/
``--keep-every`` also whole versions, by the library's retention planner: alias targets,
every delta base of a kept version and every base a live save names are always kept.
A live save (fresh claim) is never touched, nor a temp file younger than --orphan-age
(another process may be writing it). ``--dry-run`` lists what would go and how many bytes
that frees, and what is skipped and why, and changes nothing.

What is planned is looked at again right before it is removed, since a job may share the
run meanwhile: an unfinished folder goes only while its claim is still the abandoned one the
plan saw (or it still has none) and it holds no manifest; orphans only while their version's
manifest still leaves them out; a version only while it is still the one planned. Anything
changed since is skipped, saying why.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from mithril_async.claims import CLAIM_STALE_S
from mithril_async.commands._common import (
    Target,
    human,
    locate,
    print_json,
    progress_bar,
    run_async,
    table,
)

#: the config's default ([checkpointing.pipeline] orphan_age_s), repeated here so ``mithril
#: --help`` need not import the config models (tests/faults/test_shared_run.py checks they
#: agree); CLAIM_STALE_S comes from the small claims module
ORPHAN_AGE_S = 600.0


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
    p.add_argument("--claim-stale", type=float, default=CLAIM_STALE_S, metavar="SECONDS",
                   help="an unfinished save whose claim's heartbeat is older than this is "
                        "abandoned (default: the config's pipeline.claim_stale_s, %(default)s)")
    p.add_argument("--orphan-age", type=float, default=ORPHAN_AGE_S, metavar="SECONDS",
                   help="temp files / uploads younger than this may belong to a running save "
                        "and are kept (default: the config's pipeline.orphan_age_s, "
                        "%(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (and no progress bar)")
    p.set_defaults(func=run)


async def _size(store: Any, key: str) -> int:
    try:
        return int(await store.size(key))
    except Exception:
        return 0


async def plan_run(target: Target, run_id: str, args: argparse.Namespace
                   ) -> list[dict[str, Any]]:
    """What gc would do in one run: [{kind, what, keys, bytes}], and [{kind: "skip", what,
    why}] for what it leaves alone. Kinds: unfinished, orphan, incomplete, retention, skip."""
    from mithril_async.claims import claim_token, describe_claim
    from mithril_async.manifest import version_number
    from mithril_async.retention import from_options, plan_deletions
    from mithril_async.storage.base import key_in_prefix

    if args.keep_best and not args.metric:
        raise ValueError("--keep-best needs --metric")
    cat = target.catalog(run_id)
    cat.claim_stale_s = args.claim_stale
    store, lay = cat.store, cat.layout
    out: list[dict[str, Any]] = []
    numbers = await cat.version_numbers()
    stale, live = await cat.unfinished(numbers=numbers)
    for n, doc in stale.items():
        out.append({"kind": "unfinished", "what": lay.version_dir(n), "claim_token":
                    claim_token(doc), "keys": await store.list(lay.version_dir(n) + "/")})
    for n, doc in live.items():
        out.append({"kind": "skip", "what": lay.version_dir(n), "keys": [], "live": True,
                    "why": f"live save: {describe_claim(doc)}"})
    for n, committed in sorted(numbers.items()):
        if not committed:
            continue
        keys = await store.list(lay.version_dir(n) + "/")
        m = await cat.read_manifest(lay.manifest_key(n))
        named = set(m.all_keys()) | {lay.manifest_key(n), lay.claim_key(n)}
        orphans = [k for k in keys if k not in named]
        if orphans:
            out.append({"kind": "orphan", "what": lay.version_dir(n), "keys": orphans})
    live_dirs = [lay.version_dir(n) for n in live]
    dead_dirs = [lay.version_dir(n) for n in stale]
    for left in await store.list_incomplete(lay.root + "/"):
        if any(key_in_prefix(left.key, d) for d in live_dirs):
            why = "part of a live save"
        elif left.age_s < args.orphan_age and not any(key_in_prefix(left.key, d)
                                                      for d in dead_dirs):
            why = (f"{left.age_s:.0f} s old, younger than --orphan-age {args.orphan_age:g} s: "
                   "may belong to a running save")
        else:
            out.append({"kind": "incomplete", "what": left.key, "keys": []})
            continue
        out.append({"kind": "skip", "what": left.key, "keys": [], "why": why})
    policy = from_options(keep_last=args.keep_last, keep_best=args.keep_best,
                          metric=args.metric, mode=args.mode,
                          keep_every_n_steps=args.keep_every)
    for v in await plan_deletions(cat, policy):
        keys = await store.list(lay.version_dir(version_number(v.version_id)) + "/")
        out.append({"kind": "retention", "what": v.version_id, "keys": keys,
                    "step": v.step, "created_at": v.created_at.isoformat()})
    for item in out:
        item["bytes"] = sum([await _size(store, k) for k in item["keys"]])
    return out


async def _still_planned(cat: Any, item: dict[str, Any]) -> str | None:
    """Why a planned removal of a committed version's files must be left alone now (None:
    go ahead): the version was deleted since (its number may be claimed again), replaced by
    another version under its number, or its manifest now names a planned orphan."""
    from mithril_async.errors import InvalidFormat, KeyNotFound
    from mithril_async.manifest import version_number

    n = version_number(item["what"].rsplit("/", 1)[-1])
    try:
        m = await cat.read_manifest(cat.layout.manifest_key(n))
    except (KeyNotFound, InvalidFormat) as err:
        return f"its manifest changed since gc looked ({type(err).__name__})"
    if item["kind"] == "retention" and (m.step, m.created_at.isoformat()) != (
            item["step"], item["created_at"]):
        return f"another version was committed as {m.version_id} since gc looked"
    if item["kind"] == "orphan" and set(item["keys"]) & set(m.all_keys()):
        return "its manifest names these files now"
    return None


async def apply_run(target: Target, run_id: str, plan: list[dict[str, Any]],
                    args: argparse.Namespace,
                    progress: Callable[[int], None] | None = None) -> None:
    """Carry out ``plan``; leftovers of unfinished writes go by the same rules it was made
    with (a gone writer's whatever their age, a live save's never, others by age). Each
    removal first checks that what it removes is still what was planned (see the module
    doc); an item left alone becomes a ``skip`` saying why. ``progress``: each item's
    planned bytes once it is handled (removed or left alone)."""
    from mithril_async.manifest import version_number

    cat = target.catalog(run_id)
    lay = cat.layout
    for item in plan:
        why = None
        planned = item["bytes"]
        if item["kind"] == "retention":
            why = await _still_planned(cat, item)
            if why is None:
                await cat.delete_version(item["what"])
        elif item["kind"] == "unfinished":
            why = await cat.remove_unfinished(version_number(item["what"].rsplit("/", 1)[-1]),
                                              item["claim_token"])
        elif item["kind"] == "orphan":
            why = await _still_planned(cat, item)
            for key in item["keys"] if why is None else []:
                await cat.store.delete(key)
        if why is not None:
            item.update(kind="skip", why=f"left alone: {why}", keys=[], bytes=0)
        if progress is not None:
            progress(planned)
    # saves that started since the plan are as live as those it saw
    _, live_now = await cat.unfinished()
    live = {i["what"] + "/" for i in plan if i.get("live")}
    live |= {lay.version_dir(n) + "/" for n in live_now}
    await cat.store.cleanup_incomplete(lay.root + "/", args.orphan_age, skip=sorted(live))
    if any(i["kind"] == "retention" for i in plan):
        from mithril_async.storage.capabilities import local_root

        await cat.update_run_manifest(local_root(cat.store), None)


async def gc(target: Target, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    plans = {}
    for run_id in target.run_ids:
        plans[run_id] = await plan_run(target, run_id, args)
        if not args.dry_run:
            todo = sum(i["bytes"] for i in plans[run_id])
            with progress_bar(args, f"gc {run_id}", todo) as bar:
                await apply_run(target, run_id, plans[run_id], args, bar.callback)
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
    if args.quiet:
        return 0
    rows = [["RUN", "KIND", "WHAT", "FILES", "SIZE"]]
    for run_id, plan in plans.items():
        rows += [[run_id, i["kind"], i["what"], str(len(i["keys"])), human(i["bytes"])]
                 for i in plan if i["kind"] != "skip"]
    if len(rows) > 1:
        table(rows)
    for i in [i for p in plans.values() for i in p if i["kind"] == "skip"]:
        print(f"{'would skip' if args.dry_run else 'skipped'} {i['what']}: {i['why']}")
    done = sum(1 for p in plans.values() for i in p if i["kind"] != "skip")
    verb = "would free" if args.dry_run else "freed"
    print(f"{verb} {human(total)} in {done} item(s)")
    return 0
