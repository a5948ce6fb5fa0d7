"""Export of a sharded run to Hugging Face's format: time and peak memory.

``--world`` gloo ranks hold a model of ``--mparams`` million fp32 parameters (1024 x 1024
weight-like matrices, ``Shard(0)`` DTensors as FSDP2 lays them out) and save it once through
``CheckpointManager(..., sharded_model=True)`` and once with ``torch.distributed.checkpoint``.
Then, each in a fresh process (so its peak RSS is its own), for every ``--sizes`` value:

* ours: ``export_hf(run, out, max_shard_size=...)``: the saved pieces consolidated into full
  tensors one output file at a time;
* DCP: what conversion scripts do: ``dcp_to_torch_save`` (the whole model into one ``.pt``),
  ``torch.load``, ``huggingface_hub.save_torch_state_dict(..., max_shard_size=...)``.

Reported per system and size: median seconds over ``--repeats`` runs, and the highest peak
extra RSS (peak minus the RSS before the export began, sampled every 2 ms).

    python benchmarks/bench_export.py [--mparams 268] [--world 2] [--sizes 5GB,500MB,100MB]
                                      [--repeats 3] [--raw]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rss import PeakRSS
from bench_dist import build_model

from mithril_async import CheckpointManager, parse_config
from mithril_async.distributed import DistCoordinator
from mithril_async.sharded import ShardedModel


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = build_model(args.mparams, world)
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp}/runs"\nrun_id = "bench"\n'
                       f"[checkpointing.compression]\nenabled = {str(not args.raw).lower()}\n")
    with CheckpointManager(cfg, {"model": ShardedModel(model)}, sharded_model=True,
                           coordinator=DistCoordinator(timeout_s=600)) as manager:
        manager.save_nowait(1).result()
    dcp.save(get_model_state_dict(model), checkpoint_id=f"{tmp}/dcp")
    dist.barrier()
    dist.destroy_process_group()


def child(system: str, tmp: str, size: str, out: str) -> dict[str, Any]:
    """One export in this (fresh) process: seconds and peak extra RSS."""
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        if system == "ours":
            from mithril_async.export import export_hf

            export_hf(f"{tmp}/runs/bench", out, max_shard_size=size)
        else:
            from huggingface_hub import save_torch_state_dict
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(f"{tmp}/dcp", f"{tmp}/full.pt")
            sd = torch.load(f"{tmp}/full.pt", weights_only=True)
            Path(out).mkdir()
            save_torch_state_dict(sd, out, max_shard_size=size)
            del sd
            Path(f"{tmp}/full.pt").unlink()
        seconds = time.perf_counter() - t0
    return {"s": seconds, "peak_extra": rss.peak_extra,
            "files": len(list(Path(out).glob("*.safetensors")))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--mparams", type=float, default=268.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="5GB,500MB,100MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--raw", action="store_true", help="save without compression")
    ap.add_argument("--child", nargs=4, metavar=("SYSTEM", "TMP", "SIZE", "OUT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    tmp = tempfile.mkdtemp(prefix="bench-export-")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(args.world, port, args, tmp), nprocs=args.world)
        model_mib = args.mparams * 1e6 * 4 / 2**20
        print(f"model: {model_mib:.0f} MiB fp32 over {args.world} ranks, saved "
              f"{'uncompressed' if args.raw else 'compressed'}; {args.repeats} run(s) each")
        print(f"{'system':<6} {'max size':>8} {'files':>5} {'median s':>9} {'MiB/s':>7} "
              f"{'peak extra RSS MiB':>19}")
        for size in args.sizes.split(","):
            for system in ("ours", "dcp"):
                runs = []
                for _ in range(args.repeats):  # alternating would share the page cache alike
                    out = f"{tmp}/out"
                    got = subprocess.run([sys.executable, __file__, "--child", system, tmp,
                                          size, out], capture_output=True, text=True)
                    if got.returncode:
                        raise SystemExit(f"{system} {size} failed:\n{got.stderr}")
                    runs.append(json.loads(got.stdout.strip().splitlines()[-1]))
                    shutil.rmtree(out)
                s = statistics.median(r["s"] for r in runs)
                peak = max(r["peak_extra"] for r in runs) / 2**20
                print(f"{system:<6} {size:>8} {runs[0]['files']:>5} {s:>9.2f} "
                      f"{model_mib / s:>7.0f} {peak:>19.0f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
