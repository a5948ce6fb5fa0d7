"""Thousands of ranks, simulated in one process: what a save and a restore cost rank 0, every
rank and the store as the job grows.

Each world size N runs the library's real save and restore paths for N ranks of one job:

- the ranks coordinate through :class:`~mithril_async.testing.ranks.SimGroup` (the
  DistCoordinator protocol over an in-memory transport: pickled broadcasts and gathers);
- they write into one :class:`~mithril_async.testing.counting.CountingStore` over a
  MemoryStore (requests by kind, prefix and rank; listing sizes; bytes per prefix);
- the state is FSDP2-like (:func:`~mithril_async.testing.sharded.fsdp_state`): ``--params``
  parameters (336 by default: with their ``exp_avg`` / ``exp_avg_sq`` that is 1,008 sharded
  tensors, plus a step counter each), tiny (4 rows per rank), on a 1-D mesh (``--tp 1``) or a
  2-D ``(N / tp, tp)`` one, so only metadata and protocol costs remain.

Rank 0 and up to ``--sample`` other ranks are real ``CheckpointManager``\\ s (their own
background loop and codec thread, as in a job). Up to ``--real-max`` ranks every rank is real;
above, the other ranks are *replayed*: a coroutine per rank (on one loop thread) that makes
the requests a rank's save makes (its two blobs as multipart uploads with the same number of
parts as a real rank's, its RNG file) and takes part in every collective with the part a real
rank sends (the sampled rank 1's, with its own keys, rank and mesh coordinate). Blobs are
counted as S3's streaming writer sends them (one PUT under a part, else multipart). The state's
values are then one constant per tensor, so every rank's blobs hold the same bytes and the
replayed blobs restore correctly; with all ranks real they depend on the global position.

All simulated ranks share one heap; before each save it is frozen (``gc.freeze``), so the
collections rank 0 triggers scan what it allocated, as in a job, not every rank's objects.

Per save (``--saves``, ``keep_last = --keep``): CPU of rank 0's commit (from every part
received to the verdict: parts validated, manifest built, checked and written) and of what
follows (aliases, run.json, retention), on rank 0's loop thread's own clock; each sampled
rank's part (snapshot on the caller's thread, encode/write/report on its loop and codec
threads, measured one rank at a time); the manifest's bytes; requests by kind (all ranks,
rank 0, a sampled rank); listings (keys returned); the busiest prefix's writes and its
modelled write rate (every rank writing its bytes at ``--rank-gbps`` in ``--part-mib``
parts); rank 0's tracemalloc peak during the commit (last save, traced separately).

Per restore target (same world, N/2, 2N) for a few ranks of the target world (after one
untimed warm-up plan; the heap frozen as for saves): resolving
``latest`` and reading + validating the manifest (a fresh catalog), the restore plan
(``make_plan`` with the live targets), a full ``restore_sync`` (manager start-up, then the
restore; restored bytes checked), and the requests each rank made.

    python benchmarks/bench_ranks.py --ranks 8 64 512 4096 16384 --json out.json \\
        --png docs/bench_ranks.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import xxhash

from mithril_async import CheckpointManager
from mithril_async.catalog import RunCatalog
from mithril_async.config import Config, config_from_dict
from mithril_async.layout import RunLayout
from mithril_async.live import LiveState
from mithril_async.pipeline.loop import BackgroundLoop
from mithril_async.restore.plan import make_plan
from mithril_async.save.coordinator import RankPart
from mithril_async.storage.memory import MemoryStore
from mithril_async.testing.counting import READS, WRITES, CountingStore
from mithril_async.testing.ranks import SimCoordinator, SimGroup
from mithril_async.testing.sharded import Mesh, SimShardedState, fsdp_state, mesh_for

RUN = "sim"
PREFIX = "runs"
MiB = 1 << 20


# ------------------------------------------------------------------ clocks
def _clock(ident: int | None) -> int | None:
    return None if ident is None else time.pthread_getcpuclockid(ident)


class Clocks:
    """CPU time of a set of threads (their own clocks: other threads' work never counts)."""

    def __init__(self, idents: list[int]) -> None:
        self.ids = [time.pthread_getcpuclockid(i) for i in idents]

    def now(self) -> float:
        return sum(time.clock_gettime(c) for c in self.ids)


def manager_threads(mgr: CheckpointManager) -> list[int]:
    """Idents of a manager's loop thread and codec thread (started here if needed)."""
    loop = mgr._started(maintain=False)
    pool = mgr._pool.submit(threading.get_ident).result()
    ident = loop.thread.ident
    assert ident is not None
    return [ident, pool]


# ------------------------------------------------------------------ config
def make_config(keep: int) -> Config:
    return config_from_dict({"checkpointing": {
        "run_id": RUN, "runs_path": PREFIX, "keep_last": keep,
        "compression": {"threads": 1},
        "pipeline": {"claim_stale_s": 3600.0}}})


@dataclass
class RealRank:
    rank: int
    mgr: CheckpointManager
    model: SimShardedState
    opt: SimShardedState
    clocks: Clocks


@dataclass
class SaveNumbers:
    step: int
    commit_cpu_s: float = 0.0
    after_commit_cpu_s: float = 0.0
    commit_wall_s: float = 0.0
    part_cpu_s: dict[int, float] = field(default_factory=dict)
    snapshot_cpu_s: dict[int, float] = field(default_factory=dict)
    replay_cpu_s: float = 0.0
    manifest_bytes: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    rank0_requests: dict[str, int] = field(default_factory=dict)
    rank_requests: dict[str, int] = field(default_factory=dict)
    list_requests: int = 0
    listed_keys: int = 0
    busiest_write_prefix: str = ""
    busiest_writes: int = 0
    modelled_write_rate: float = 0.0
    modelled_prefix: str = ""
    prefixes_written: int = 0
    rank0_peak_mib: float | None = None


@dataclass
class RestoreNumbers:
    world: int
    rank: int
    manifest_cpu_s: float
    plan_cpu_s: float
    start_cpu_s: float
    restore_cpu_s: float
    requests: int
    gets: int
    mismatches: int
    blobs_read: int


class Job:
    """One simulated job of ``n`` ranks saving into one counting store."""

    def __init__(self, n: int, *, params: int, tp: int, real_max: int, sample: int,
                 keep: int, latency_s: float = 0.0, inflight: int | None = None) -> None:
        self.n, self.params, self.tp, self.keep = n, params, tp, keep
        self.mesh = mesh_for(n, tp)
        self.store = CountingStore(MemoryStore(), latency_s=latency_s, max_inflight=inflight,
                                   part_bytes=ARGS.part_mib * MiB)
        self.group = SimGroup(n)
        self.layout = RunLayout(PREFIX, RUN)
        everyone = n <= real_max
        self.fill = "index" if everyone else "const"
        if everyone:
            real = list(range(n))
        else:
            picks = {0, 1, 2, n // 4, n // 2, n // 2 + 1, n - 2, n - 1}
            real = sorted(picks)[: sample + 1] if sample + 1 < len(picks) else sorted(picks)
            real = sorted({0, 1} | set(real))
        self.real: list[RealRank] = []
        for r in real:
            model, opt = fsdp_state(params, self.mesh, r, fill=self.fill)  # type: ignore[arg-type]
            mgr = CheckpointManager(make_config(keep), {"model": model, "optimizer": opt},
                                    store=self.store.view(r), runs_prefix=PREFIX,
                                    coordinator=self.group.coordinator(r), sharded_model=True)
            self.real.append(RealRank(r, mgr, model, opt, Clocks(manager_threads(mgr))))
        self.replayed = [r for r in range(n) if r not in set(real)]
        self.replay_coords = {r: self.group.coordinator(r) for r in self.replayed}
        self.replay_loop = BackgroundLoop("replay") if self.replayed else None
        self.group.keep("gather_parts", {1} if n > 1 else set())

    def close(self) -> None:
        for rr in self.real:
            rr.mgr.close()
        if self.replay_loop is not None:
            self.replay_loop.close()

    # -------------------------------------------------------------- save
    def save(self, step: int, *, trace_memory: bool = False) -> SaveNumbers:
        out = SaveNumbers(step)
        log, group = self.store.log, self.group
        log.clear()
        # every simulated rank's objects live in this one heap: frozen, so that a collection
        # during rank 0's commit scans what a rank 0 of a real job would have, not them all
        gc.collect()
        gc.freeze()
        group.forget()
        group.hold("gather_parts")
        main = Clocks([threading.get_ident()])
        handles = {}
        for rr in self.real:  # one rank at a time, each until its part is reported
            t0 = main.now()
            handles[rr.rank] = rr.mgr.save_nowait(step)
            t1, c1 = main.now(), rr.clocks.now()
            if not group.wait_arrived("gather_parts", rr.rank, 600):
                raise RuntimeError(f"rank {rr.rank} never reported its part: "
                                   f"{handles[rr.rank].future.exception(0)}")
            out.snapshot_cpu_s[rr.rank] = t1 - t0
            out.part_cpu_s[rr.rank] = rr.clocks.now() - c1
        replay_done = None
        if self.replayed:
            assert self.replay_loop is not None
            replay_clock = Clocks([self.replay_loop.thread.ident or 0])
            c0 = replay_clock.now()
            replay_done = self.replay_loop.submit(self._replay_all(step))
            while group.arrived("gather_parts") < self.n:
                if replay_done.done():
                    replay_done.result()
                time.sleep(0.01)
            out.replay_cpu_s = replay_clock.now() - c0
        rank0 = self.real[0]
        assert rank0.rank == 0
        if trace_memory:
            gc.collect()
            tracemalloc.start()
        loop0 = Clocks([manager_threads(rank0.mgr)[0]])
        c0, w0 = loop0.now(), time.perf_counter()
        group.release("gather_parts")
        if not group.wait_arrived("broadcast_outcome", 0, 600):
            raise RuntimeError(f"rank 0 never decided: {handles[0].future.exception(0)}")
        out.commit_cpu_s = loop0.now() - c0
        out.commit_wall_s = time.perf_counter() - w0
        if trace_memory:
            out.rank0_peak_mib = tracemalloc.get_traced_memory()[1] / MiB
            tracemalloc.stop()
        c1 = loop0.now()
        handles[0].result()
        out.after_commit_cpu_s = loop0.now() - c1
        for h in handles.values():
            h.result()
        if replay_done is not None:
            replay_done.result()
        gc.unfreeze()
        self._count(out, step)
        return out

    def _count(self, out: SaveNumbers, step: int) -> None:
        log = self.store.log
        out.requests = dict(log.by_kind)
        out.rank0_requests = {k: n for (r, k), n in log.by_rank.items() if r == 0}
        probe = self.real[1].rank if len(self.real) > 1 else 0
        out.rank_requests = {k: n for (r, k), n in log.by_rank.items() if r == probe}
        out.list_requests = log.by_kind.get("list", 0) + log.by_kind.get("list_dir", 0)
        out.listed_keys = log.listed_keys()
        out.busiest_write_prefix, out.busiest_writes = log.busiest(WRITES)
        rates = log.modelled_write_rate(ARGS.part_mib * MiB, ARGS.rank_gbps * 1e9)
        if rates:
            out.modelled_prefix, out.modelled_write_rate = max(rates.items(),
                                                                key=lambda kv: kv[1])
        out.prefixes_written = len(rates)
        m = asyncio.run(self._manifest_bytes(step))
        out.manifest_bytes = m

    async def _manifest_bytes(self, step: int) -> int:
        cat = RunCatalog(self.store.inner, self.layout)
        alias = await cat.read_alias("latest")
        assert alias is not None and alias.step == step and alias.manifest_key
        return await self.store.inner.size(alias.manifest_key)

    # -------------------------------------------------------------- replayed ranks
    async def _replay_all(self, step: int) -> None:
        first = self.replay_coords[self.replayed[0]]
        number = await first.agree_version(_never)
        tmpl = await self._template(number)
        await asyncio.gather(self._replay(self.replayed[0], first, number, step, tmpl,
                                          agreed=True),
                             *(self._replay(r, self.replay_coords[r], number, step, tmpl)
                               for r in self.replayed[1:]))

    async def _template(self, number: int) -> dict[str, Any]:
        """Rank 1's part as it sent it, its blobs' bytes and part counts, its RNG doc."""
        while ("gather_parts", 1) not in self.group.kept:
            await asyncio.sleep(0.01)
        part = self.group.kept["gather_parts", 1]
        inner = self.store.inner
        blobs = {item: await inner.get(ref["key"]) for item, ref in part["shards"].items()}
        rng = json.loads(await inner.get(part["rng_key"]))
        return {"part": part, "blobs": blobs, "rng": rng}

    async def _replay(self, r: int, coord: SimCoordinator, number: int, step: int,
                      tmpl: dict[str, Any], agreed: bool = False) -> None:
        if not agreed:
            await coord.agree_version(_never)
        view = self.store.view(r)
        part = dict(tmpl["part"])
        shards = {}
        for item, ref in part["shards"].items():
            key = self.layout.shard_key(number, item, r)
            await view.stand_in_upload(key, tmpl["blobs"][item])  # the same bytes, no copy
            new = {**ref, "key": key, "rank": r}
            if "coord" in ref:
                new["coord"] = list(self.mesh.coord(r))
            if "pieces" in ref:  # a part that lists every piece (no piece layouts)
                new["pieces"] = _pieces_json(self.params, self.mesh, r)[item]
            shards[item] = new
        doc = {**tmpl["rng"], "rank": r}
        data = json.dumps(doc).encode()
        rng_key = self.layout.rng_key(number, r)
        await view.put(rng_key, data)
        part.update(rank=r, shards=shards, rng_key=rng_key, rng_bytes=len(data),
                    rng_xxh64=xxhash.xxh64_hexdigest(data))
        await coord.gather_parts(RankPart.model_validate(part))
        await coord.broadcast_outcome(None)

    # -------------------------------------------------------------- restore
    def restore(self, world: int) -> list[RestoreNumbers]:
        mesh = mesh_for(world, self.tp)
        ranks = sorted({0, 1, world // 2, world - 1} & set(range(world)))
        gc.collect()
        gc.freeze()  # as for saves: a restoring rank's collections scan its own objects
        try:
            self._restore_rank(world, mesh, ranks[-1], timed=False)  # warm-up, not counted
            return [self._restore_rank(world, mesh, r) for r in ranks]
        finally:
            gc.unfreeze()

    def _restore_rank(self, world: int, mesh: Mesh, r: int, timed: bool = True
                      ) -> RestoreNumbers:
        model, opt = fsdp_state(self.params, mesh, r, fill=self.fill,  # type: ignore[arg-type]
                                saved_mesh=self.mesh)
        states = {"model": model, "optimizer": opt}
        tag = 10_000_000 + r
        view = self.store.view(tag)
        log = self.store.log
        main = Clocks([threading.get_ident()])

        got: list[Any] = []

        async def read() -> None:  # (a big object returned through asyncio.run is repr'd)
            cat = RunCatalog(view, self.layout)
            got.append(await cat.read_manifest(await cat.resolve("latest")))

        t0 = main.now()
        asyncio.run(read())
        t1 = main.now()
        m = got[0]
        plan = make_plan(m, rank=r, world_size=world, rng=True, live=LiveState(states))
        t2 = main.now()
        blobs_read = len([k for k in plan.keys() if not k.endswith(".json")])  # noqa: SIM118
        if not timed:
            return RestoreNumbers(world, r, t1 - t0, t2 - t1, 0.0, 0.0, 0, 0, 0, blobs_read)
        model.scramble()
        opt.scramble()
        before = log.of_rank(tag)
        before_gets = log.of_rank(tag, READS)
        mgr = CheckpointManager(make_config(self.keep), states, store=view, runs_prefix=PREFIX,
                                coordinator=SimGroup(world).coordinator(r),
                                sharded_model=True)
        try:
            # the manager's start (its loop's first use: versions listed, manifests read);
            # the process's clock, nothing else runs meanwhile
            s0 = time.process_time()
            threads = Clocks([*manager_threads(mgr), threading.get_ident()])
            start = time.process_time() - s0
            s1 = threads.now()
            with _quiet():
                mgr.restore_sync("latest")
            s2 = threads.now()
        finally:
            mgr.close()
        return RestoreNumbers(world, r, t1 - t0, t2 - t1, start, s2 - s1,
                              log.of_rank(tag) - before + 0,
                              log.of_rank(tag, READS) - before_gets,
                              len(model.mismatches()) + len(opt.mismatches()), blobs_read)


async def _never() -> int:  # pragma: no cover - only rank 0 claims
    raise AssertionError("only rank 0 claims a version")


_PIECES: dict[tuple[int, tuple[int, ...], int], dict[str, Any]] = {}


def _pieces_json(params: int, mesh: Mesh, r: int) -> dict[str, Any]:
    """Rank ``r``'s pieces as a part lists them (for libraries without piece layouts)."""
    model, opt = fsdp_state(params, mesh, r, fill="const")
    return {"model": {n: p.model_dump(mode="json") for n, p in
                      ((n, model.piece(n)) for n in model.plans)},
            "optimizer": {n: p.model_dump(mode="json") for n, p in
                          ((n, opt.piece(n)) for n in opt.plans)}}


@contextmanager
def _quiet() -> Iterator[None]:
    lg = logging.getLogger("mithril_async")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(level)


# ------------------------------------------------------------------ driver
def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) against log(x) (None with < 2 usable points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def run_world(n: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    job = Job(n, params=ARGS.params, tp=ARGS.tp, real_max=ARGS.real_max, sample=ARGS.sample,
              keep=ARGS.keep, latency_s=ARGS.latency_ms / 1e3, inflight=ARGS.inflight)
    try:
        saves = []
        for s in range(1, ARGS.saves + 1):
            saves.append(job.save(s, trace_memory=ARGS.memory and s == ARGS.saves))
            _progress(f"N={n} save {s}: commit {saves[-1].commit_cpu_s:.3f}s cpu, manifest "
                      f"{saves[-1].manifest_bytes / MiB:.2f} MiB")
        restores: dict[str, Any] = {}
        if not ARGS.no_restore:
            for label, world in (("same", n), ("half", max(1, n // 2)), ("double", 2 * n)):
                if ARGS.tp > 1 and world % ARGS.tp:
                    continue
                try:
                    got = job.restore(world)
                except Exception as err:  # a library that cannot restore it: say why
                    restores[label] = {"error": f"{type(err).__name__}: {err}"[:300]}
                    _progress(f"N={n} restore {label} ({world}) failed: {err}")
                    continue
                restores[label] = [x.__dict__ for x in got]
                _progress(f"N={n} restore {label} ({world}): plan "
                          f"{max(x.plan_cpu_s for x in got):.3f}s, mismatches "
                          f"{sum(x.mismatches for x in got)}")
    finally:
        job.close()
    return {"n": n, "params": ARGS.params, "tp": ARGS.tp, "real": [r.rank for r in job.real],
            "saves": [s.__dict__ for s in saves], "restores": restores,
            "wall_s": time.perf_counter() - t_start}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ranked(d: dict[Any, float]) -> dict[int, float]:
    """A per-rank dict with int keys (JSON made them strings)."""
    return {int(k): v for k, v in d.items()}


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per world size: the last save (steady state) and the worst restoring rank."""
    rows = []
    for res in results:
        last = res["saves"][-1]
        timed = [s for s in res["saves"] if s["rank0_peak_mib"] is None] or res["saves"]
        steady = timed[1:] or timed
        # requests of a save in the steady state that retention deleted nothing in (the
        # deletes of a retention victim, 3 per rank, are counted apart)
        plain = [s for s in res["saves"][1:] if not s["rank0_requests"].get("delete")]
        norm = plain[-1] if plain else last
        row: dict[str, Any] = {
            "N": res["n"],
            "manifest_MiB": last["manifest_bytes"] / MiB,
            "commit_s": statistics.median(s["commit_cpu_s"] for s in steady),
            "after_commit_s": statistics.median(s["after_commit_cpu_s"] for s in steady),
            "rank_part_s": statistics.median(v for s in steady
                                             for r, v in _ranked(s["part_cpu_s"]).items()
                                             if r != 0),
            "rank0_part_s": statistics.median(_ranked(s["part_cpu_s"])[0] for s in steady),
            "rank0_peak_MiB": next((s["rank0_peak_mib"] for s in res["saves"]
                                    if s["rank0_peak_mib"] is not None), None),
            "requests": sum(norm["requests"].values()),
            "rank0_requests": sum(norm["rank0_requests"].values()),
            "rank_requests": sum(norm["rank_requests"].values()),
            "retention_deletes": max(s["rank0_requests"].get("delete", 0)
                                     for s in res["saves"]),
            "list_requests": norm["list_requests"],
            "listed_keys": norm["listed_keys"],
            "busiest_prefix_writes": last["busiest_writes"],
            "modelled_writes_per_s": last["modelled_write_rate"],
            "prefixes": last["prefixes_written"],
        }
        for label, rs in res["restores"].items():
            if isinstance(rs, dict):
                row[f"restore_error_{label}"] = rs["error"]
                continue
            row[f"manifest_read_{label}_s"] = max(x["manifest_cpu_s"] for x in rs)
            row[f"plan_{label}_s"] = max(x["plan_cpu_s"] for x in rs)
            row[f"restore_{label}_s"] = max(x["restore_cpu_s"] for x in rs)
            row[f"start_{label}_s"] = max(x["start_cpu_s"] for x in rs)
            row[f"restore_requests_{label}"] = max(x["requests"] for x in rs)
            row[f"mismatches_{label}"] = sum(x["mismatches"] for x in rs)
        rows.append(row)
    return rows


SAVE_COLUMNS = [
    ("N", "N", "{:d}"), ("manifest MiB", "manifest_MiB", "{:.2f}"),
    ("rank 0 commit s", "commit_s", "{:.3f}"),
    ("rank 0 aliases+run.json+retention s", "after_commit_s", "{:.3f}"),
    ("rank 0 peak MiB", "rank0_peak_MiB", "{:.1f}"),
    ("each rank's part s", "rank_part_s", "{:.3f}"), ("rank 0's part s", "rank0_part_s", "{:.3f}"),
    ("requests", "requests", "{:d}"), ("rank 0 req", "rank0_requests", "{:d}"),
    ("other rank req", "rank_requests", "{:d}"), ("listed keys", "listed_keys", "{:d}"),
    ("retention deletes", "retention_deletes", "{:d}"),
    ("busiest prefix writes/s", "modelled_writes_per_s", "{:.0f}"),
]
RESTORE_COLUMNS = [
    ("N", "N", "{:d}"), ("manifest read s", "manifest_read_same_s", "{:.3f}"),
    ("plan same s", "plan_same_s", "{:.3f}"), ("plan N/2 s", "plan_half_s", "{:.3f}"),
    ("plan 2N s", "plan_double_s", "{:.3f}"), ("manager start s", "start_same_s", "{:.3f}"),
    ("restore same s", "restore_same_s", "{:.3f}"), ("restore N/2 s", "restore_half_s", "{:.3f}"),
    ("restore 2N s", "restore_double_s", "{:.3f}"),
    ("req same", "restore_requests_same", "{:d}"), ("req N/2", "restore_requests_half", "{:d}"),
    ("req 2N", "restore_requests_double", "{:d}"),
]


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``columns`` with rows of log-log slopes against N: over every
    world size, and between the two largest (where fixed costs no longer hide the growth)."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join("---:" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            v = row.get(key)
            cells.append("—" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    top = sorted(r["N"] for r in rows)[-2:]
    for label, use in (("slope, all N", rows),
                       (f"slope, {top[0]} to {top[-1]}", [r for r in rows if r["N"] in top])):
        slopes = [label]
        for _, key, _fmt in columns[1:]:
            s = slope([r["N"] for r in use if r.get(key) is not None],
                      [float(r[key]) for r in use if r.get(key) is not None])
            slopes.append("—" if s is None else f"{s:.2f}")
        lines.append("| " + " | ".join(slopes) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str,
         before: list[dict[str, Any]] | None = None) -> None:
    """CPU per save / restore against N (left); manifest size and the busiest S3 prefix's
    modelled write rate (right); ``before``: the same of another library, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    lines = (("commit_s", "rank 0: commit"),
             ("after_commit_s", "rank 0: aliases, run.json, retention"),
             ("rank_part_s", "each rank: its part of a save"),
             ("manifest_read_same_s", "each rank: manifest read + validated"),
             ("plan_half_s", "each rank: restore plan N -> N/2"),
             ("plan_double_s", "each rank: restore plan N -> 2N"),
             ("restore_half_s", "each rank: whole restore N -> N/2"))
    for i, (key, label) in enumerate(lines):
        color = f"C{i}"
        pts = [(r["N"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=label)
        old = [(r["N"], r[key]) for r in before or [] if r.get(key) is not None]
        if old:
            ax.plot(*zip(*old, strict=True), marker="x", ls="--", color=color, alpha=0.6)
    for x, label in ((2.0, "2 s"), (0.2, "0.2 s")):
        ax.axhline(x, color="grey", ls=":", lw=1)
        ax.text(rows[0]["N"], x * 1.08, label, color="grey", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("CPU seconds (one core)")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("per save and per restore (dashed: before)")
    for key, label, scale, marker, color in (
            ("manifest_MiB", "manifest MiB", 1.0, "o", "C0"),
            ("modelled_writes_per_s", "busiest prefix, k writes/s", 1e-3, "s", "C1")):
        bx.plot([r["N"] for r in rows], [r[key] * scale for r in rows], marker=marker,
                color=color, label=label)
        if before:
            bx.plot([r["N"] for r in before], [r[key] * scale for r in before], marker="x",
                    ls="--", color=color, alpha=0.6)
    bx.axhline(3.5, color="grey", ls=":", lw=1)
    bx.text(rows[0]["N"], 3.5 * 1.1, "S3: 3.5 k writes/s per prefix", color="grey", fontsize=7)
    bx.axhline(64, color="grey", ls=":", lw=1)
    bx.text(rows[0]["N"], 64 * 1.1, "64 MiB: the largest manifest read", color="grey",
            fontsize=7)
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xlabel("ranks N")
    bx.legend(fontsize=7, loc="lower right")
    bx.set_title("manifest size, S3 prefix write rate (modelled; dashed: before)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096, 16384])
    p.add_argument("--params", type=int, default=336)
    p.add_argument("--tp", type=int, default=1, help="> 1: a 2-D (N / tp, tp) mesh")
    p.add_argument("--real-max", type=int, default=64,
                   help="up to this many ranks, every rank is a real manager")
    p.add_argument("--sample", type=int, default=6, help="real ranks besides rank 0 above")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--keep", type=int, default=3, help="keep_last")
    p.add_argument("--part-mib", type=int, default=8)
    p.add_argument("--rank-gbps", type=float, default=1.0)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--inflight", type=int, default=None)
    p.add_argument("--memory", action="store_true", help="trace rank 0's commit (last save)")
    p.add_argument("--no-restore", action="store_true")
    p.add_argument("--json", default=None, help="append each world's results here")
    p.add_argument("--rows", default=None, help="summarise this JSON-lines file instead")
    p.add_argument("--png", default=None)
    p.add_argument("--before", default=None,
                   help="a JSON-lines file of another library's run, dashed in the plot")
    ARGS = p.parse_args()
    if ARGS.rows:
        with open(ARGS.rows) as f:
            results = [json.loads(line) for line in f if line.strip()]
    else:
        results = []
        for n in ARGS.ranks:
            res = run_world(n)
            results.append(res)
            if ARGS.json:
                with open(ARGS.json, "a") as f:
                    f.write(json.dumps(res) + "\n")
    rows = summarize(sorted(results, key=lambda r: r["n"]))
    print(table(rows, SAVE_COLUMNS))
    print()
    print(table(rows, RESTORE_COLUMNS))
    errors = {k: v for r in rows for k, v in r.items() if k.startswith("restore_error")}
    for key, err in errors.items():
        print(f"{key}: {err}")
    if ARGS.png:
        before = None
        if ARGS.before:
            with open(ARGS.before) as f:
                before = summarize(sorted((json.loads(line) for line in f if line.strip()),
                                          key=lambda r: r["n"]))
        plot(rows, ARGS.png, before)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
