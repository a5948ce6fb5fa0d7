"""Restore benchmark (issue 25): a GPT-like many-tensor state from the page cache, restored by
mithril (compressed and uncompressed, straight into the live tensors) vs ``torch.load``,
``safetensors.torch.load_file`` (every page touched), ``dcp.load`` (into preallocated
tensors) and torch_checkpointing's ``CheckpointManager.load(id, into=...)`` (into the live
tensors; skipped, with the reason printed, where it is not installed), all in this one
process, medians of ``--runs``; with each one's peak extra RSS.

The state: a GPT-like model in bf16 (``--layers`` blocks of 12 tensors, d_model ``--d``) and
fp32 AdamW moments for every parameter (``exp_avg``, ``exp_avg_sq``) plus a step counter per
parameter: 4 tensors per parameter (924 tensors, ~1.0 GiB with the defaults). Every system
reads the same files' worth of bytes from the page cache (each is loaded once before timing).

    python benchmarks/bench_restore.py [--runs 5] [--layers 19] [--d 640] [--dir /dev/shm]
                                       [--only dcp,torch_checkpointing,mithril]
    python benchmarks/bench_restore.py --reshard [--runs 3] [--reshard-layers 6]

Prints one line per system: median seconds, GB/s of state, ratio to ``torch.load``,
``dcp.load`` and torch_checkpointing's load (time, ours/theirs: below 1 is faster), peak extra
RSS. ``--layers 22`` is a ~1.1 GiB state; ``--dir`` is where the files are (default: the temp
dir; ``/dev/shm``: tmpfs). "mithril compressed" restores with the
default ``verify = "block"`` (one read, every block verified before it is written);
"verify=whole" rows verify every blob whole before the first write (two reads). Uncompressed
blobs have no per-block hashes and take the two-read path in both modes. "before" rows run the
restore path as it was before issue 25 (decode into fresh tensors, then ``load_state_dict``)
in the same process.

    python benchmarks/bench_restore.py --s3 [--runs 3] [--s3-mib 128] [--s3-server rgw]

restores a fp32 state of ``--s3-mib`` MiB from a moto server (its own process; or a real
Ceph RGW started here, ``--s3-server rgw``) with
``mode = "remote_only"``: ``verify = "block"`` (in place, memory bounded by the in-flight
budget), ``"whole"`` (decoded into fresh tensors, then loaded) and a plain parallel download
of the same blobs (boto3 ``download_fileobj``, 8 threads) as the anchor. moto copies a whole
object for every ranged GET, so ranged restores are slower there than on S3.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _tc
from _rss import PeakRSS

from mithril_async import CheckpointManager, parse_config


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)


class GPTLike(torch.nn.Module):
    def __init__(self, layers: int, d: int, vocab: int = 16384, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)


class Moments(torch.nn.Module):
    """fp32 AdamW moments and step counters of every parameter of ``model``, as buffers."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        for name, p in model.named_parameters():
            key = name.replace(".", "_")
            self.register_buffer(f"exp_avg_{key}", torch.zeros(p.shape, dtype=torch.float32))
            self.register_buffer(f"exp_avg_sq_{key}", torch.zeros(p.shape, dtype=torch.float32))
            self.register_buffer(f"step_{key}", torch.zeros((), dtype=torch.float32))


def make_state(layers: int, d: int, seed: int) -> tuple[GPTLike, Moments]:
    torch.manual_seed(seed)
    with torch.no_grad():
        model = GPTLike(layers, d).to(torch.bfloat16)
        for p in model.parameters():
            p.normal_(0, 0.02)
        moments = Moments(model)
        for name, b in moments.named_buffers():
            if name.startswith("exp_avg_sq"):
                b.normal_(0, 1e-4).square_()
            elif name.startswith("exp_avg"):
                b.normal_(0, 1e-3)
            else:
                b.fill_(1000.0)
    return model, moments


def flat(model: torch.nn.Module, moments: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    out.update({f"optimizer.{k}": v for k, v in moments.state_dict().items()})
    return out


#: torch_checkpointing's row: ``CheckpointManager.load(id, into=...)`` into the live tensors
TC_LOAD = "torch_checkpointing.load (into live)"


def items(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A flat state (see :func:`flat`) as torch_checkpointing's items: model, optimizer."""
    return {item: {k: v for k, v in tensors.items() if k.startswith(f"{item}.")}
            for item in ("model", "optimizer")}


def touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read every byte of every tensor (a lazily mapped load pays for its reads here)."""
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).max()


def config(runs: Path, compress: bool) -> Any:
    return parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "bench"\n'
                        f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n")


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only): the next read of a file comes from
    the disk, as a restore on a node that has just started."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def timed(fn: Callable[[], Any], runs: int, cold: bool = False) -> tuple[float, int]:
    """Median seconds of ``runs`` calls (after one warm-up call) and the largest peak extra
    RSS among them; ``cold``: the page cache dropped before each call."""
    fn()
    gc.collect()
    times, peaks = [], []
    for _ in range(runs):
        gc.collect()
        if cold:
            drop_page_cache()
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        peaks.append(rss.peak_extra)
        del out
    return statistics.median(times), max(peaks)


# ------------------------------------------------------------------ resharded restores
def _reshard_rank(rank: int, world: int, port: int, what: str, runs: str, layers: int,
                  d: int, reps: int, out: Any) -> None:
    """One rank: ``save`` a DTensor-sharded (Shard(0)) fp32 GPT-like model and its AdamW
    state, or ``restore`` it ``reps`` times into fresh state (seconds per restore to ``out``)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mithril_async.sharded import ShardedModel, ShardedOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0 if what == "save" else 1)
    model = GPTLike(layers, d)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the moments
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "bench"\n'
                       "[checkpointing.compression]\nthreads = 1\n")
    state = {"model": ShardedModel(model), "optimizer": ShardedOptimizer(model, opt)}
    with CheckpointManager(cfg, state, sharded_model=True) as mgr:
        if what == "save":
            mgr.save_nowait(1).result()
        else:
            times, peaks = [], []
            for _ in range(reps + 1):  # the first warms the page cache
                dist.barrier()
                with PeakRSS() as rss:
                    t0 = time.perf_counter()
                    mgr.restore_sync("latest")
                    times.append(time.perf_counter() - t0)
                peaks.append(rss.peak_extra)
            out.put((rank, times[1:], max(peaks)))
    dist.destroy_process_group()


def _launch(world: int, what: str, runs: Path, layers: int, d: int, reps: int
            ) -> tuple[list[float], int]:
    """Run ``world`` ranks; for a restore, the per-repetition time of the slowest rank and
    the largest peak extra RSS of any rank in any repetition (the warm-up one included)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reshard_rank, args=(r, world, port, what, str(runs), layers,
                                                     d, reps, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get() for _ in range(world)] if what == "restore" else []
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"{what} rank exited with {p.exitcode}"
    if not got:
        return [], 0
    return ([max(times[i] for _, times, _ in got) for i in range(reps)],
            max(peak for _, _, peak in got))


def reshard_bench(layers: int, d: int, reps: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_reshard_"))
    try:
        for w in (2, 4):
            _launch(w, "save", tmp / f"saved{w}", layers, d, reps)
        rows, peaks = {}, {}
        for saved, world in ((2, 2), (4, 2), (4, 4), (2, 4)):
            times, peaks[(saved, world)] = _launch(world, "restore", tmp / f"saved{saved}",
                                                   layers, d, reps)
            rows[(saved, world)] = statistics.median(times)
        model = GPTLike(layers, d)
        n = sum(1 for _ in model.parameters())
        state = 3 * sum(p.numel() * 4 for p in model.parameters())  # weights + 2 moments
        print(f"resharded restore: fp32 GPT-like ({layers} layers, d={d}; {n} parameters, "
              f"AdamW state; Shard(0) DTensors; {state / 2**20:.0f} MiB in all), slowest "
              f"rank, median of {reps}; peak extra RSS: the most of any rank and restore")
        for (saved, world), sec in rows.items():
            same = rows[(world, world)]
            print(f"  saved by {saved}, restored on {world}: {sec:7.3f} s  "
                  f"vs same-world restore on {world}: {sec / same:5.2f}x  peak extra RSS "
                  f"{peaks[(saved, world)] / 2**20:7.1f} MiB (local state "
                  f"{state / world / 2**20:.0f} MiB)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ from S3 (moto)
class Weights(torch.nn.Module):
    """``n`` fp32 matrices of 2048 x 2048 (16 MiB each)."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(2048, 2048, generator=g)
                                                           * 0.02) for _ in range(n))


@contextlib.contextmanager
def s3_server(kind: str) -> Iterator[str]:
    """An S3 endpoint on 127.0.0.1 with bucket ``bench``: moto in its own process, or a real
    Ceph RGW (tests/rgw_server.py, ~20 s to start). Dummy credentials only."""
    import os

    import boto3

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    if kind == "rgw":
        from tests.rgw_server import CephRGW

        with CephRGW(bucket="bench", block_gib=8.0) as rgw:
            yield rgw.endpoint_url
        return
    from bench_s3 import free_port, start_moto

    port = free_port()
    proc = start_moto(port)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="bench")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def s3_bench(mib: int, reps: int, kind: str) -> None:
    """Restores from an S3 server (remote_only): block vs whole vs a plain parallel download
    of the same blobs."""
    with s3_server(kind) as endpoint:
        _s3_bench(endpoint, mib, reps, kind)


def _s3_bench(endpoint: str, mib: int, reps: int, kind: str) -> None:
    import io

    import boto3
    from bench_s3 import remote_only_config
    from boto3.s3.transfer import TransferConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_restore_s3_"))
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        n = max(1, mib // 16)
        saved = Weights(n, 0)
        live = Weights(n, 1)
        nbytes = sum(p.numel() * 4 for p in saved.parameters())
        where = "moto, its own process" if kind == "moto" else "Ceph RGW"
        print(f"S3 ({where}): fp32 state {nbytes / 2**20:.0f} MiB ({n} tensors), "
              f"remote_only, median of {reps}")
        transfer = TransferConfig(max_concurrency=8, multipart_chunksize=8 << 20)
        for comp in (True, False):
            label = "compressed" if comp else "uncompressed"
            prefix = f"r{label}"
            with CheckpointManager(remote_only_config(str(tmp / "runs"), "bench", prefix,
                                                      endpoint, 8, 8, comp),
                                   {"model": saved}) as m:
                m.save_nowait(1).result()
            keys = [o["Key"] for o in client.list_objects_v2(
                Bucket="bench", Prefix=prefix)["Contents"]
                    if o["Key"].endswith((".mckp", ".bin", ".safetensors"))]
            mgr = CheckpointManager(remote_only_config(str(tmp / "runs"), "bench", prefix,
                                                       endpoint, 8, 8, comp), {"model": live})

            def download(keys: list[str] = keys) -> None:
                for k in keys:
                    client.download_fileobj("bench", k, io.BytesIO(), Config=transfer)

            rows = {
                "verify=block": lambda m=mgr: m.restore_sync("latest", verify="block"),
                "verify=whole": lambda m=mgr: m.restore_sync("latest", verify="whole"),
                "plain download (boto3)": download,
            }
            out = {name: timed(fn, reps) for name, fn in rows.items()}
            mgr.close()
            ok = all(torch.equal(a, b) for a, b in zip(live.parameters(), saved.parameters(),
                                                        strict=True))
            anchor = out["plain download (boto3)"][0]
            for name, (sec, peak) in out.items():
                print(f"  {label:<12} {name:<24} {sec:7.3f} s  vs download {sec / anchor:5.2f}x"
                      f"  peak extra RSS {peak / 2**20:8.1f} MiB", flush=True)
            print(f"  {label}: live state equals the saved one: {ok}")
            with torch.no_grad():  # the next round restores into other values again
                for p in live.parameters():
                    p.add_(1.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--d", type=int, default=640)
    ap.add_argument("--only", default="", help="comma-separated systems to run")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the saved files are (default: the temp dir; /dev/shm: tmpfs)")
    ap.add_argument("--reshard", action="store_true",
                    help="only the resharded restores (2 <-> 4 ranks, gloo) vs same-world")
    ap.add_argument("--reshard-layers", type=int, default=6)
    ap.add_argument("--s3", action="store_true",
                    help="only the restores from S3 (moto): verify=block/whole vs a download")
    ap.add_argument("--s3-mib", type=int, default=128)
    ap.add_argument("--s3-server", choices=["moto", "rgw"], default="moto")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before every timed restore (needs root): "
                         "from the disk, as on a node that has just started")
    args = ap.parse_args()
    if args.cold:
        try:
            drop_page_cache()
        except OSError as err:
            ap.error(f"--cold drops the page cache, which needs root: {err}")
    if args.reshard:
        reshard_bench(args.reshard_layers, args.d, args.runs)
        return
    if args.s3:
        s3_bench(args.s3_mib, args.runs, args.s3_server)
        return
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    model, moments = make_state(args.layers, args.d, seed=0)
    sd = flat(model, moments)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"state: {len(sd)} tensors, {nbytes / 2**30:.3f} GiB; torch threads "
          f"{torch.get_num_threads()}; runs {args.runs} (median)"
          f"{'; page cache dropped before each run' if args.cold else ''}")
    tc_why = _tc.missing()
    print(tc_why or f"{_tc.NAME} {_tc.version()}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_restore_", dir=args.dir))
    tc: _tc.Tc | None = None
    try:
        torch.save(sd, tmp / "state.pt")
        safetensors.torch.save_file(sd, str(tmp / "state.safetensors"))
        dcp.save(sd, checkpoint_id=str(tmp / "dcp"))
        if tc_why is None:  # its sync saver: the same files, no writer process to start
            tc = _tc.Tc(sync=True)
            tc.save(tmp / "tc", items(sd)).result()
        for compress in (True, False):
            runs = tmp / ("runs_c" if compress else "runs_u")
            with CheckpointManager(config(runs, compress),
                                   {"model": model, "optimizer": moments}) as m:
                m.save_nowait(1).result()
        live_model, live_moments = make_state(args.layers, args.d, seed=1)
        live = flat(live_model, live_moments)

        def ours(compress: bool, verify: Any = "block") -> Callable[[], Any]:
            runs = tmp / ("runs_c" if compress else "runs_u")
            mgr = CheckpointManager(config(runs, compress),
                                    {"model": live_model, "optimizer": live_moments})
            managers.append(mgr)
            return lambda: mgr.restore_sync("latest", verify=verify)

        def before(compress: bool) -> Callable[[], Any]:
            """The restore as it was before issue 25, for comparison: every item decoded
            into fresh tensors (the whole blob read and hashed first), then
            ``load_state_dict`` copies them into the live ones."""
            runs = tmp / ("runs_c" if compress else "runs_u")
            mgr = CheckpointManager(config(runs, compress),
                                    {"model": live_model, "optimizer": live_moments})
            managers.append(mgr)

            def run() -> Any:
                decoded = mgr._bg(mgr.restorer.reader.read_version("latest", rank=0,
                                                                    world_size=1))
                return mgr.restorer.apply(decoded, "all")

            return run

        managers: list[CheckpointManager] = []
        live_items = items(live)
        systems: dict[str, Callable[[], Any]] = {
            "torch.load": lambda: torch.load(tmp / "state.pt", weights_only=True),
            "safetensors.load_file": lambda: (
                lambda t: (touch(t), t)[1])(safetensors.torch.load_file(
                    str(tmp / "state.safetensors"))),
            "dcp.load (into live)": lambda: dcp.load(live, checkpoint_id=str(tmp / "dcp")),
            TC_LOAD: lambda: tc.load(tmp / "tc", live_items) if tc else None,
            "mithril compressed": ours(True),
            "mithril compressed, verify=whole": ours(True, "whole"),
            "mithril uncompressed": ours(False),
            "mithril compressed, before": before(True),
            "mithril uncompressed, before": before(False),
        }
        if tc is None:
            del systems[TC_LOAD]
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        results: dict[str, tuple[float, int]] = {}
        for name, fn in systems.items():
            if only and not any(o in name for o in only):
                continue
            results[name] = timed(fn, args.runs, args.cold)
            s, peak = results[name]
            print(f"  {name:<37} {s:7.3f} s  {nbytes / s / 1e9:6.2f} GB/s  "
                  f"peak extra RSS {peak / 2**20:8.1f} MiB", flush=True)
        for mgr in managers:
            mgr.close()
        if tc is not None:
            tc.close()
            tc = None
        ok = all(torch.equal(live[k], sd[k]) for k in sd)
        print(f"live state after the restores equals the saved one: {ok}")
        base = results.get("torch.load")
        dcp_s = results.get("dcp.load (into live)")
        tc_s = results.get(TC_LOAD)
        for name, (s, _peak) in results.items():
            line = f"  {name:<37}"
            if base:
                line += f"  time vs torch.load {s / base[0]:5.2f}x"
                line += f"  throughput vs torch.load {base[0] / s:5.2f}x"
            if dcp_s:
                line += f"  time vs dcp.load {s / dcp_s[0]:5.2f}x"
            if tc_s:
                line += f"  time vs {_tc.NAME} load {s / tc_s[0]:5.2f}x"
            print(line)
    finally:
        if tc is not None:
            tc.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
