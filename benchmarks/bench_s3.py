"""S3Store throughput against aioboto3's own managed transfers, on a loopback moto server.

Upload: ``S3Store.open_writer`` (streaming multipart, bounded concurrency, CRC32 per part)
vs ``client.upload_fileobj`` (aioboto3's managed multipart) of the same bytes.
Download: ``S3Store.get`` (parallel ranged GETs pinned to one ETag) vs
``client.download_fileobj``. Same part size and concurrency for both; ours and theirs
alternate, medians of N runs each.

moto runs in its own process (``python -m moto.server``) so the client and server do not
share a GIL. On loopback the server is usually the bottleneck, so the interesting number is
the ratio ours/theirs, not the absolute MB/s.

Pipeline: a whole checkpoint (weight-like fp32 tensors) saved by ``CheckpointManager`` with
``mode = "remote_only"`` (snapshot, encode, multipart upload, manifest, aliases) with
compression off and on, vs ``upload_fileobj`` of the same state's safetensors bytes; and
``restore_sync("latest")`` (parallel ranged GETs, decode, copy into the live tensors) vs
``download_fileobj``.

    python benchmarks/bench_s3.py --mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aioboto3
import safetensors.torch
import torch
from boto3.s3.transfer import TransferConfig

from mithril_async import CheckpointManager, TensorDict, parse_config
from mithril_async.storage.s3 import S3Store

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(2048 * MIB))  # keep in memory
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def bench(endpoint: str, mib: int, repeats: int, part_mib: int, conc: int) -> None:
    bucket = "bench"
    data = os.urandom(mib * MIB)
    session = aioboto3.Session()
    store = S3Store(
        bucket,
        "ours",
        endpoint_url=endpoint,
        region_name="us-east-1",
        part_size=part_mib * MIB,
        max_concurrency=conc,
        session=session,
    )
    tconf = TransferConfig(
        multipart_threshold=part_mib * MIB,
        multipart_chunksize=part_mib * MIB,
        max_concurrency=conc,
    )
    async with session.client("s3", endpoint_url=endpoint, region_name="us-east-1") as client:
        await client.create_bucket(Bucket=bucket)

        async def ours_up() -> None:
            w = store.open_writer("blob")
            view = memoryview(data)
            for i in range(0, len(view), 4 * MIB):  # a producer writing 4 MiB chunks
                await w.write(view[i : i + 4 * MIB])
            await w.commit()

        async def theirs_up() -> None:
            await client.upload_fileobj(io.BytesIO(data), bucket, "theirs/blob", Config=tconf)

        async def ours_down() -> None:
            assert len(await store.get("blob")) == len(data)

        async def theirs_down() -> None:
            out = io.BytesIO()
            await client.download_fileobj(bucket, "theirs/blob", out, Config=tconf)
            assert out.getbuffer().nbytes == len(data)

        runs = [
            ("upload ours", ours_up),
            ("upload aioboto3", theirs_up),
            ("download ours", ours_down),
            ("download aioboto3", theirs_down),
        ]
        results: dict[str, list[float]] = {name: [] for name, _ in runs}
        # ours and theirs alternate, so drift in machine load hits both alike
        for pair in (runs[:2], runs[2:]):
            for i in range(repeats):
                for name, fn in pair if i % 2 == 0 else pair[::-1]:
                    results[name].append(await timed(fn))
    await store.close()

    mbps = {k: mib * MIB / 1e6 / statistics.median(v) for k, v in results.items()}
    print(f"\n{mib} MiB blob, {part_mib} MiB parts, concurrency {conc}, median of {repeats}")
    print(f"{'operation':<20}{'MB/s':>10}{'median s':>12}")
    for k, v in results.items():
        print(f"{k:<20}{mbps[k]:>10.1f}{statistics.median(v):>12.3f}")
    up = mbps["upload ours"] / mbps["upload aioboto3"]
    down = mbps["download ours"] / mbps["download aioboto3"]
    print(f"ratio ours/aioboto3: upload {up:.2f}x, download {down:.2f}x")



def bench_pipeline(endpoint: str, mib: int, repeats: int, part_mib: int, conc: int) -> None:
    """Whole checkpoints through the manager vs aioboto3 transfers of the same bytes."""
    g = torch.Generator().manual_seed(0)
    n = max(1, mib // 16)
    state = {f"w{i}": torch.randn(2048, 2048, generator=g) * 0.02 for i in range(n)}
    raw = safetensors.torch.save(state)
    times: dict[str, list[float]] = {}
    for comp in (False, True):
        label = "zstd" if comp else "raw"
        cfg = parse_config(
            f'[checkpointing]\nruns_path = "runs"\nrun_id = "p{label}"\n'
            f'[checkpointing.remote]\nbucket = "bench"\nprefix = "pipe"\n'
            f'endpoint_url = "{endpoint}"\nregion_name = "us-east-1"\nmode = "remote_only"\n'
            f"part_mib = {part_mib}\nmax_concurrency = {conc}\n"
            f"[checkpointing.compression]\nenabled = {str(comp).lower()}\n")
        with CheckpointManager(cfg, {"model": TensorDict(state)}) as m:
            for i in range(repeats):
                t0 = time.perf_counter()
                m.save_nowait(i + 1).result()
                times.setdefault(f"save mithril ({label})", []).append(time.perf_counter() - t0)
            for _ in range(repeats):
                t0 = time.perf_counter()
                m.restore_sync("latest")
                times.setdefault(f"restore mithril ({label})", []).append(
                    time.perf_counter() - t0)

    async def theirs() -> None:
        tconf = TransferConfig(multipart_threshold=part_mib * MIB,
                               multipart_chunksize=part_mib * MIB, max_concurrency=conc)
        async with aioboto3.Session().client("s3", endpoint_url=endpoint,
                                             region_name="us-east-1") as client:
            for _ in range(repeats):
                t0 = time.perf_counter()
                await client.upload_fileobj(io.BytesIO(raw), "bench", "pipe/theirs.safetensors",
                                            Config=tconf)
                times.setdefault("upload_fileobj", []).append(time.perf_counter() - t0)
            for _ in range(repeats):
                out = io.BytesIO()
                t0 = time.perf_counter()
                await client.download_fileobj("bench", "pipe/theirs.safetensors", out,
                                              Config=tconf)
                times.setdefault("download_fileobj", []).append(time.perf_counter() - t0)

    asyncio.run(theirs())
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = len(raw) / 1e6
    print(f"\ncheckpoint of {mb:.0f} MB (fp32 weight-like), median of {repeats}")
    print("| operation | s | MB/s of state | ours / aioboto3 (time) |")
    print("|---|---:|---:|---:|")
    for k, v in med.items():
        if k.endswith("_fileobj"):
            print(f"| {k} (aioboto3) | {v:.3f} | {mb / v:.1f} | 1.00 |")
            continue
        ref = med["upload_fileobj"] if k.startswith("save") else med["download_fileobj"]
        print(f"| {k} | {v:.3f} | {mb / v:.1f} | {v / ref:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="blob size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--endpoint", default=None, help="use this S3 endpoint instead of moto")
    args = ap.parse_args()
    proc = None
    endpoint = args.endpoint
    if endpoint is None:  # local moto: dummy credentials, never the caller's real ones
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        os.environ.pop("AWS_SESSION_TOKEN", None)
        port = free_port()
        proc = start_moto(port)
        endpoint = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(bench(endpoint, args.mib, args.repeats, args.part_mib, args.concurrency))
        bench_pipeline(endpoint, args.mib, args.repeats, args.part_mib, args.concurrency)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
