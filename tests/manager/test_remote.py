"""The manager against a real S3 server (moto over HTTP on 127.0.0.1): mirror, remote_only."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from mithril_async import CheckpointManager, parse_config
from tests.manager.conftest import make_state, state_equal, train_step
from tests.ranks import free_port
from tests.s3_server import MotoS3, dummy_env


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with MotoS3() as server:
        yield server


def _cfg(s3: MotoS3, runs: Path, prefix: str, mode: str, run_id: str = "r1") -> str:
    return (f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "{run_id}"\n'
            f"[checkpointing.remote]\nbucket = \"{s3.bucket}\"\nprefix = \"{prefix}\"\n"
            f'endpoint_url = "{s3.endpoint_url}"\nregion_name = "us-east-1"\nmode = "{mode}"\n'
            "part_mib = 5\n[checkpointing.compression]\nchunk_mib = 1\n")


def test_mirror_writes_same_keys_and_restores_from_bucket_alone(s3: MotoS3,
                                                               tmp_path: Path) -> None:
    prefix = s3.unique_prefix("mirror")
    cfg = parse_config(_cfg(s3, tmp_path / "runs", prefix, "mirror"))
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        for step in (1, 2):
            train_step(model, opt, batcher)
            m.save_nowait(step).result()
        saved = copy.deepcopy(model.state_dict())
    local = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*")
                   if p.is_file())
    remote = sorted(k[len(prefix) + 1:] for k in s3.objects(prefix))
    assert local == remote and "runs/r1/versions/v000002/manifest.json" in remote
    manifest = (tmp_path / "runs/r1/versions/v000002/manifest.json").read_text()
    assert f"s3://{s3.bucket}/{prefix}" in manifest
    shutil.rmtree(tmp_path / "runs")  # the machine lost its disk: only the bucket remains
    model2, opt2, _ = make_state(seed=5)
    with CheckpointManager(cfg, {"model": model2, "optimizer": opt2}) as m:
        assert m.restore_sync("latest") == 2
    assert state_equal(saved, model2.state_dict())


def test_remote_only_streams_multipart_and_restores_elsewhere(s3: MotoS3,
                                                              tmp_path: Path) -> None:
    prefix = s3.unique_prefix("remote")
    cfg = parse_config(_cfg(s3, tmp_path / "a" / "runs", prefix, "remote_only") +
                       "enabled = false\n")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 3000)  # ~12 MiB of fp32: several 5 MiB parts
    with CheckpointManager(cfg, {"model": model}) as m:
        m.save_nowait(7).result()
    assert not any((tmp_path / "a").rglob("*.safetensors"))  # nothing on local disk
    key = f"{prefix}/runs/r1/versions/v000001/model.safetensors"
    etag = s3.client.head_object(Bucket=s3.bucket, Key=key)["ETag"].strip('"')
    assert etag.endswith("-3")  # uploaded as a 3-part multipart upload while encoding
    assert s3.uploads(prefix) == []  # nothing left incomplete
    other = torch.nn.Linear(1024, 3000)
    cfg2 = parse_config(_cfg(s3, tmp_path / "b" / "runs", prefix, "remote_only"))
    with CheckpointManager(cfg2, {"model": other}) as m:
        assert m.restore_sync("latest") == 7
        assert m.all_steps() == [7]
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


@pytest.mark.parametrize("compressed", [False, True])
def test_remote_only_restore_reads_each_blob_once(s3: MotoS3, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  compressed: bool) -> None:
    """Over S3 a restore reads each blob once (every block still verified), never verifying
    it in a separate pass first (a second read of every byte over the network): compressed
    blobs one pass straight into the live tensors (``verify = "block"``, the default),
    uncompressed ones (one whole-file hash, no per-block ones) into fresh tensors."""
    import mithril_async.restore.execute as execute
    from mithril_async.storage.s3.store import S3Store

    prefix = s3.unique_prefix("once")
    cfg = parse_config(_cfg(s3, tmp_path / "runs", prefix, "remote_only") +
                       f"enabled = {str(compressed).lower()}\n")
    model, opt, batcher = make_state()
    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
        train_step(model, opt, batcher)
        m.save_nowait(1).result()
    saved = copy.deepcopy(model.state_dict())
    stored = sum(s3.client.head_object(Bucket=s3.bucket, Key=k)["ContentLength"]
                 for k in s3.objects(prefix) if k.endswith((".mckp", ".safetensors", ".bin")))

    read = [0]
    get_range = S3Store.get_range

    async def counting(self: S3Store, key: str, offset: int, length: int) -> bytes:
        data = await get_range(self, key, offset, length)
        read[0] += len(data)
        return data

    def no_second_pass(*a: object, **k: object) -> None:
        raise AssertionError("a blob on S3 was verified in a separate pass")

    monkeypatch.setattr(S3Store, "get_range", counting)
    monkeypatch.setattr(execute, "verify_blob", no_second_pass)
    model2, opt2, batcher2 = make_state(seed=5)
    train_step(model2, opt2, batcher2)  # the optimizer has moments to restore into
    ptrs = {n: t.data_ptr() for n, t in model2.state_dict().items()}
    with CheckpointManager(cfg, {"model": model2, "optimizer": opt2}) as m:
        assert m.restore_sync("latest") == 1
    assert state_equal(saved, model2.state_dict())
    assert read[0] <= stored  # ranged reads of the blobs add up to at most one pass
    if compressed:  # in place: every byte of the blobs read by ranges, exactly once
        assert read[0] == stored
        assert {n: t.data_ptr() for n, t in model2.state_dict().items()} == ptrs


@contextlib.contextmanager
def moto_process() -> Iterator[str]:
    """A moto server in a process of its own (its copies of objects are not this process's
    memory), with dummy credentials; yields its endpoint."""
    port = free_port()
    with dummy_env():
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(1 << 30)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):  # waits for the server to listen (not a timing assertion)
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise RuntimeError("moto server exited") from None
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(30)


def test_block_restore_from_s3_is_in_place_with_memory_bounded_by_the_budget(
        tmp_path: Path) -> None:
    """``verify = "block"`` restores an S3 blob straight into the live tensors through
    windows bounded by ``max_inflight_mib`` (8 MiB here): the Python memory it allocates
    (tracemalloc: response bodies, windows, decode buffers) stays near the budget for a
    48 MiB state, where ``"whole"`` (decode into fresh tensors, then load) holds more than
    the state."""
    import tracemalloc

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])

    with moto_process() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="mem")

        def cfg(runs: Path) -> Any:
            return parse_config(
                f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "r1"\n'
                f'[checkpointing.remote]\nbucket = "mem"\nprefix = "p"\n'
                f'endpoint_url = "{endpoint}"\nregion_name = "us-east-1"\n'
                'mode = "remote_only"\npart_mib = 5\n[checkpointing.compression]\n'
                "chunk_mib = 1\n[checkpointing.pipeline]\nmax_inflight_mib = 8\n")

        model = net(0)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with CheckpointManager(cfg(tmp_path / "a" / "runs"), {"model": model}) as m:
            m.save_nowait(1).result()
        live = net(5)
        ptrs = [p.data_ptr() for p in live.parameters()]
        peaks = {}
        with CheckpointManager(cfg(tmp_path / "b" / "runs"), {"model": live}) as m:
            for mode in ("block", "whole"):
                with torch.no_grad():
                    for p in live.parameters():
                        p.add_(1.0)  # other values than the saved ones
                tracemalloc.start()
                try:
                    assert m.restore_sync("latest", verify=mode) == 1
                    peaks[mode] = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
                assert all(torch.equal(a, b) for a, b in zip(live.parameters(),
                                                              model.parameters(), strict=True))
                if mode == "block":
                    assert [p.data_ptr() for p in live.parameters()] == ptrs
    assert nbytes > 48 << 20
    assert peaks["block"] < (8 << 20) + (16 << 20), peaks  # the budget + slack
    assert peaks["whole"] > nbytes, peaks  # what the measurement would show without it
