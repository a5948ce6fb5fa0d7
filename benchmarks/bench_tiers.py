"""Multi-tier checkpoints: restore time from each tier, save time to reach each tier.

Two ranks (gloo, real processes) as two "nodes" (``LOCAL_WORLD_SIZE=1``, a local folder each),
the remote tier on a moto S3 server on loopback started here. Each rank holds ``--mib`` MiB of
bf16 weights of its own (a sharded model: every rank writes and restores its own blob). For
compression on and off, ``--runs`` rounds of:

- save, local-only anchor: a plain CheckpointManager on one LocalStore the two ranks share
  (no tiers), same processes:
  its stall (``save()`` blocking) and time to commit;
- save, tiered (a manager whose config has a ``[checkpointing.tiers]`` table): stall, time
  to the local commit, to the peer replica, to the remote;
- restore from the own local tier; from the peer replica (each node's own folder wiped, the
  copies the other node holds come over gloo); from the remote (both folders wiped);
  and the anchor's local restore.

Times are the slowest rank's; medians over the runs. Ratios (ours/theirs): peer/remote (target
<= 0.3), peer/local (target <= 1.5; "local" is the tiered local restore, the plain anchor's
is printed too), tiered stall / local-only stall (target <= 1). A tiered restore returns
once the state is restored; the copies it fetched are written back into the node folder in
the background (``manager.tiers.wait()``, untimed; ``--phases`` prints when it ended).

    python benchmarks/bench_tiers.py [--mib 256] [--runs 3] [--phases]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

WORLD = 2


def _state(mib: int, rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.Module()
    per = 16 << 20  # 16 MiB tensors (8 Mi bf16 values)
    for i in range(max(1, (mib << 20) // per)):
        t = (torch.randn(per // 2, generator=gen) * 0.02).to(torch.bfloat16)
        model.register_parameter(f"w{i}", torch.nn.Parameter(t, requires_grad=False))
    return {"model": model}


def _cfg(compress: bool, run_id: str, tiers: str = "") -> Any:
    from mithril_async import parse_config

    return parse_config(f'[checkpointing]\nruns_path = "runs"\nrun_id = "{run_id}"\n'
                        f"keep_last = 2\n[checkpointing.compression]\n"
                        f"enabled = {str(compress).lower()}\nthreads = 1\n{tiers}")


def _slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn(*args)
    return out, _slowest(time.perf_counter() - t0)


def rank_main(rank: int, port: int, a: dict[str, Any]) -> None:
    os.environ.update(a["env"])
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    from mithril_async import CheckpointManager
    from mithril_async.distributed import DistCoordinator
    from mithril_async.storage import open_store
    from mithril_async.storage.local import LocalStore

    base = Path(a["base"])
    rows: dict[str, list[float]] = {}

    def add(name: str, v: float) -> None:
        rows.setdefault(name, []).append(v)

    state = _state(a["mib"], rank)
    for compress in (True, False):
        tag = "on" if compress else "off"
        # the anchor's ranks share one folder (a plain multi-rank run on one machine)
        anchor_store = LocalStore(base / f"anchor-{tag}")
        anchor = CheckpointManager(_cfg(compress, f"anchor-{tag}"), state, store=anchor_store,
                                   coordinator=DistCoordinator(timeout_s=600),
                                   sharded_model=True)
        remote = open_store({"bucket": a["bucket"], "prefix": f"{a['prefix']}-{tag}",
                             "endpoint_url": a["endpoint"]})
        (base / f"tiers-{tag}").mkdir(exist_ok=True)
        table = (f'[checkpointing.tiers]\nlocal = "{base / f"tiers-{tag}"}/node{{node}}"\n'
                 "replicas = 1\ncommit_timeout_s = 600\n")
        mgr = CheckpointManager(_cfg(compress, f"tiered-{tag}", table), state,
                                tier_remote=remote, sharded_model=True)
        tiers = mgr.tiers
        assert tiers is not None
        root = tiers.root
        for run in range(a["runs"]):
            step = run + 1
            dist.barrier()
            res = anchor.save_nowait(step).result()
            add(f"{tag} save stall, local-only", _slowest(res.stall_s))
            add(f"{tag} save to local, local-only", _slowest(res.total_s))
            dist.barrier()
            handle = mgr.save_nowait(step)
            add(f"{tag} save stall, tiered", _slowest(handle.result_obj.stall_s))
            res = handle.result()
            tiers.wait()
            tr = tiers.results[res.version_id]
            assert not tr.errors, tr.errors
            add(f"{tag} save to local, tiered", _slowest(res.total_s))
            add(f"{tag} save to replica, tiered", _slowest(res.total_s + tr.reached["replicated"]))
            add(f"{tag} save to remote, tiered", _slowest(res.total_s + tr.reached["remote"]))
            _, t = _timed(anchor.restore_sync, "latest")
            add(f"{tag} restore local, local-only", t)
            _, t = _timed(mgr.restore_sync)
            assert {str(s) for s in tiers.last_sources.values()} == {"local"}, tiers.last_sources
            add(f"{tag} restore local, tiered", t)
            if a["phases"] and rank == 0:
                print(f"{tag} local recovery phases (rank 0, cumulative s):",
                      {k: round(v, 3) for k, v in tiers.last_timings.items()}, flush=True)
            dist.barrier()
            shutil.rmtree(root / "runs")  # this node's own tier is gone; its copies stay
            _, t = _timed(mgr.restore_sync)
            assert all(str(s).endswith("(replica)") for k, s in tiers.last_sources.items()
                       if "/versions/" in k), tiers.last_sources
            add(f"{tag} restore peer replica", t)
            tiers.wait()  # the copies' write-back into the node folder (background, untimed)
            if a["phases"] and rank == 0:
                print(f"{tag} peer recovery phases (rank 0, cumulative s):",
                      {k: round(v, 3) for k, v in tiers.last_timings.items()}, flush=True)
            dist.barrier()
            shutil.rmtree(root / "runs")
            shutil.rmtree(root / "replica")
            _, t = _timed(mgr.restore_sync)
            assert {str(s) for s in tiers.last_sources.values()} == {"remote"}, tiers.last_sources
            add(f"{tag} restore remote", t)
            tiers.wait()
            dist.barrier()
        mgr.close()
        anchor.close()
    if rank == 0:
        torch.save(rows, Path(a["out"]))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="state per rank, MiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="print rank 0's recovery phases")
    args = ap.parse_args()
    from tests.s3_server import MotoS3

    with MotoS3() as s3, tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        out = Path(tmp) / "rows.pt"
        a = {"mib": args.mib, "runs": args.runs, "phases": args.phases, "base": tmp,
             "bucket": s3.bucket,
             "prefix": s3.unique_prefix("bench"), "endpoint": s3.endpoint_url, "env": s3.env,
             "out": str(out)}
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, port, a)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: {[p.exitcode for p in procs]}")
        rows = torch.load(out)
    print(f"bench_tiers: {WORLD} ranks as {WORLD} nodes, {args.mib} MiB bf16 per rank, "
          f"median of {args.runs} runs, slowest rank, {datetime.date.today()}")
    med = {k: statistics.median(v) for k, v in rows.items()}
    for k, v in rows.items():
        print(f"  {k:<36} {med[k]:8.3f} s   runs: {', '.join(f'{x:.3f}' for x in v)}")
    for tag in ("on", "off"):
        peer, remote = med[f"{tag} restore peer replica"], med[f"{tag} restore remote"]
        local = med[f"{tag} restore local, tiered"]
        plain = med[f"{tag} restore local, local-only"]
        stall, anchor = med[f"{tag} save stall, tiered"], med[f"{tag} save stall, local-only"]
        print(f"  compression {tag}: peer/remote {peer / remote:.2f} (target <= 0.3), "
              f"peer/local {peer / local:.2f} (target <= 1.5), "
              f"peer/plain local {peer / plain:.2f}, "
              f"tiered local/plain local {local / plain:.2f}, "
              f"stall tiered/local-only {stall / anchor:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
