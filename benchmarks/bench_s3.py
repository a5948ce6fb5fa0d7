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

Anchor (issue 20): AWS's ``s3torchconnector`` (its DCP ``S3StorageWriter`` /
``S3StorageReader``, the PyTorch connector people use for S3 checkpoints) against our
manager (``mode = "remote_only"``, compression off and on) and plain ``upload_fileobj`` /
``download_fileobj``, on the same server and the same state, on moto and on a real Ceph RGW
started here (tests/rgw_server.py), medians of N, runs rotating so drift hits all alike:

    python benchmarks/bench_s3.py --anchor --server both --mib 256 --repeats 3

s3torchconnector cannot save to Ceph RGW 16 directly (its CompleteMultipartUpload answers an
empty ETag; the connector fails with ``Header "ETag" not found``): there it is measured
through a relay on loopback that fills in the ETag (``FaultProxy`` ``fill_etag``), and ours
is measured both directly and through the same relay, so a like-for-like ratio exists.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aioboto3
import safetensors.torch
import torch
from boto3.s3.transfer import TransferConfig

from mithril_async import CheckpointManager, Config, TensorDict, parse_config
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



def remote_only_config(runs: str, run_id: str, prefix: str, endpoint: str, part_mib: int,
                       conc: int, compression: bool, keep_last: int | None = None) -> Config:
    """A manager writing straight to bucket ``bench`` (``mode = "remote_only"``)."""
    keep = f"keep_last = {keep_last}\n" if keep_last is not None else ""
    return parse_config(
        f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "{run_id}"\n{keep}'
        f'[checkpointing.remote]\nbucket = "bench"\nprefix = "{prefix}"\n'
        f'endpoint_url = "{endpoint}"\nregion_name = "us-east-1"\nmode = "remote_only"\n'
        f"part_mib = {part_mib}\nmax_concurrency = {conc}\n"
        f"[checkpointing.compression]\nenabled = {str(compression).lower()}\n")


def bench_pipeline(endpoint: str, mib: int, repeats: int, part_mib: int, conc: int) -> None:
    """Whole checkpoints through the manager vs aioboto3 transfers of the same bytes."""
    g = torch.Generator().manual_seed(0)
    n = max(1, mib // 16)
    state = {f"w{i}": torch.randn(2048, 2048, generator=g) * 0.02 for i in range(n)}
    raw = safetensors.torch.save(state)
    times: dict[str, list[float]] = {}
    for comp in (False, True):
        label = "zstd" if comp else "raw"
        cfg = remote_only_config("runs", f"p{label}", "pipe", endpoint, part_mib, conc, comp)
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


# -- the s3torchconnector anchor -------------------------------------------------------------
def _s3tc() -> Any:
    """The s3torchconnector DCP classes, or None when it (or its ``dcp`` extra) is missing."""
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError as exc:
        print(f"s3torchconnector missing ({exc}): pip install 's3torchconnector[dcp]==1.5.0'")
        return None
    return S3ClientConfig, S3Client, S3StorageReader, S3StorageWriter


def _s3tc_io(endpoint: str, path: str, part_mib: int) -> tuple[Any, Any]:
    """A (writer, reader) pair of s3torchconnector on ``endpoint``: its DCP classes take no
    endpoint, so their client is replaced by one made with the connector's own ``S3Client``
    (path-style addressing, our part size)."""
    config_cls, client_cls, reader_cls, writer_cls = _s3tc()
    cfg = config_cls(force_path_style=True, part_size=part_mib * MIB)
    writer = writer_cls("us-east-1", path, s3client_config=cfg)
    reader = reader_cls("us-east-1", path, s3client_config=cfg)
    for io_ in (writer, reader):
        io_.fs._client = client_cls("us-east-1", endpoint=endpoint, s3client_config=cfg)
    return writer, reader


def s3tc_direct_error(endpoint: str, part_mib: int) -> str | None:
    """One s3torchconnector save of a multipart-sized tensor straight on ``endpoint``: None
    if it works, else the error (what a user of it sees)."""
    import torch.distributed.checkpoint as dcp

    writer, _ = _s3tc_io(endpoint, "s3://bench/s3tc-direct/ckpt", part_mib)
    try:
        dcp.save({"w": torch.zeros(3 * part_mib * MIB // 4)}, storage_writer=writer)
    except BaseException as exc:  # DCP wraps the failure in a CheckpointException
        lines = [ln for ln in str(exc).splitlines() if "Exception" in ln or "error" in ln]
        return lines[-1].strip() if lines else f"{type(exc).__name__}: {exc}"
    return None


def bench_anchor(label: str, endpoint: str, mib: int, repeats: int, part_mib: int, conc: int,
                 ours_only: bool = False) -> dict[str, float]:
    """Medians (s) of saving and restoring one state: ours raw and zstd, s3torchconnector's
    DCP writer and reader, and upload_fileobj / download_fileobj of its safetensors bytes."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    n = max(1, mib // 16)
    state = {f"w{i}": torch.randn(2048, 2048, generator=g) * 0.02 for i in range(n)}
    raw = safetensors.torch.save(state)
    times: dict[str, list[float]] = {}
    runs = tempfile.mkdtemp(prefix="bench-s3-")
    managers = {}
    slug = "".join(c if c.isalnum() else "-" for c in label)
    for comp in (False, True):
        tag = "zstd" if comp else "raw"
        cfg = remote_only_config(runs, f"{slug}-{tag}", "anchor", endpoint, part_mib, conc,
                                 comp, keep_last=1)
        managers[tag] = CheckpointManager(cfg, {"model": TensorDict(state)})
    live = {k: torch.empty_like(v) for k, v in state.items()}
    has_s3tc = not ours_only and _s3tc() is not None
    tconf = TransferConfig(multipart_threshold=part_mib * MIB,
                           multipart_chunksize=part_mib * MIB, max_concurrency=conc)
    client_cm = aioboto3.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(client_cm.__aenter__())
    step = [0]

    def ours_save(tag: str) -> Callable[[], None]:
        def go() -> None:
            step[0] += 1
            managers[tag].save_nowait(step[0]).result()
        return go

    def ours_restore(tag: str) -> Callable[[], None]:
        return lambda: managers[tag].restore_sync("latest") and None

    def s3tc_save() -> None:
        writer, _ = _s3tc_io(endpoint, "s3://bench/anchor/s3tc/ckpt", part_mib)
        dcp.save(state, storage_writer=writer)

    def s3tc_restore() -> None:
        _, reader = _s3tc_io(endpoint, "s3://bench/anchor/s3tc/ckpt", part_mib)
        dcp.load(live, storage_reader=reader)

    def upload() -> None:
        loop.run_until_complete(client.upload_fileobj(
            io.BytesIO(raw), "bench", "anchor/fileobj.safetensors", Config=tconf))

    def download() -> None:
        out = io.BytesIO()
        loop.run_until_complete(client.download_fileobj(
            "bench", "anchor/fileobj.safetensors", out, Config=tconf))
        assert out.getbuffer().nbytes == len(raw)

    saves: list[tuple[str, Callable[[], None]]] = [
        ("save ours (raw)", ours_save("raw")), ("save ours (zstd)", ours_save("zstd"))]
    restores: list[tuple[str, Callable[[], None]]] = [
        ("restore ours (raw)", ours_restore("raw")), ("restore ours (zstd)", ours_restore("zstd"))]
    if has_s3tc:
        saves.append(("save s3torchconnector", s3tc_save))
        restores.append(("restore s3torchconnector", s3tc_restore))
    if not ours_only:
        saves.append(("upload_fileobj", upload))
        restores.append(("download_fileobj", download))
    try:
        for ops in (saves, restores):
            for _name, fn in ops:  # one untimed round: clients, run folders, probes
                fn()
            for i in range(repeats):  # rotate the order each round: drift hits all alike
                for name, fn in ops[i % len(ops):] + ops[: i % len(ops)]:
                    t0 = time.perf_counter()
                    fn()
                    times.setdefault(name, []).append(time.perf_counter() - t0)
        if has_s3tc:  # the anchor restored exactly what it saved
            assert all(torch.equal(live[k], state[k]) for k in state)
    finally:
        for m in managers.values():
            m.close()
        loop.run_until_complete(client_cm.__aexit__(None, None, None))
        loop.close()
        shutil.rmtree(runs, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = len(raw) / 1e6
    print(f"\n[{label}] checkpoint of {mb:.0f} MB (fp32 weight-like), median of {repeats} "
          "after one untimed round")
    print("| operation | median s | all runs s | MB/s of state |")
    print("|---|---:|---:|---:|")
    for k, v in med.items():
        runs_s = ", ".join(f"{t:.2f}" for t in times[k])
        print(f"| {k} | {v:.2f} | {runs_s} | {mb / v:.0f} |")
    for ref in ("s3torchconnector", "fileobj"):
        sref = med.get("save s3torchconnector" if ref != "fileobj" else "upload_fileobj")
        rref = med.get("restore s3torchconnector" if ref != "fileobj" else "download_fileobj")
        if sref and rref:
            print(f"ratio ours/{ref} (time; < 1 is faster): "
                  f"save raw {med['save ours (raw)'] / sref:.2f}x, "
                  f"zstd {med['save ours (zstd)'] / sref:.2f}x; "
                  f"restore raw {med['restore ours (raw)'] / rref:.2f}x, "
                  f"zstd {med['restore ours (zstd)'] / rref:.2f}x")
    return med


def run_anchor(server: str, mib: int, repeats: int, part_mib: int, conc: int) -> None:
    """The anchor on moto (its own process) and/or a real Ceph RGW (started here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(f"s3torchconnector {_version('s3torchconnector')}, moto {_version('moto')}, "
          f"torch {torch.__version__}")
    if server in ("moto", "both"):
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1")
        os.environ.pop("AWS_SESSION_TOKEN", None)
        port = free_port()
        proc = start_moto(port)
        endpoint = f"http://127.0.0.1:{port}"
        try:
            boto3_client(endpoint).create_bucket(Bucket="bench")
            bench_anchor("moto", endpoint, mib, repeats, part_mib, conc)
        finally:
            proc.terminate()
            proc.wait(10)
    if server in ("rgw", "both"):
        from tests.rgw_server import CephRGW, RGWUnavailable
        from tests.s3_server import fault_proxy

        try:
            rgw_cm = CephRGW(bucket="bench", block_gib=8.0)
            rgw = rgw_cm.__enter__()
        except RGWUnavailable as exc:
            print(f"\n[rgw] skipped: {exc}")
            return
        try:
            print(f"\n{rgw.version}")
            if _s3tc() is not None:
                error = s3tc_direct_error(rgw.endpoint_url, part_mib)
                print("s3torchconnector straight on RGW: "
                      + (f"FAILS: {error}" if error else "works"))
            bench_anchor("rgw direct (ours only)", rgw.endpoint_url, mib, repeats, part_mib,
                         conc, ours_only=True)
            with fault_proxy(rgw) as relay:
                relay.fail(lambda r: r.is_complete, "fill_etag", times=None)
                bench_anchor("rgw via ETag-filling relay", relay.endpoint_url, mib, repeats,
                             part_mib, conc)
        finally:
            rgw_cm.__exit__(None, None, None)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "missing"


def boto3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="blob size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--endpoint", default=None, help="use this S3 endpoint instead of moto")
    ap.add_argument("--anchor", action="store_true",
                    help="only the s3torchconnector anchor (issue 20), on --server")
    ap.add_argument("--server", choices=["moto", "rgw", "both"], default="both")
    args = ap.parse_args()
    if args.anchor:
        run_anchor(args.server, args.mib, args.repeats, args.part_mib, args.concurrency)
        return
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
