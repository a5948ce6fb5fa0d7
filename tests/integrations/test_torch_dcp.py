"""DCP planners: exact roundtrips in one process, across 2 real gloo ranks, and resharding."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mithril_async.integrations.torch_dcp import (
    MithrilLoadPlanner,
    MithrilSavePlanner,
    decode_item,
    encode_tensor,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(256, 64, generator=g).to(torch.bfloat16),
            "b": torch.randn(7, generator=g),
            "ids": torch.arange(5000, dtype=torch.int64),
            "mask": torch.rand(100, generator=g) > 0.5,
            "half": torch.randn(3000, generator=g).half(),
            "empty": torch.zeros(0, 3),
            "col": torch.randn(64, 256, generator=g).t(),  # non-contiguous
        },
        "step": 12,
        "meta": {"name": "tiny", "betas": (0.9, 0.99)},
    }


def _zeros_like(sd: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeros_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir())


def test_single_process_roundtrip_is_exact_and_smaller(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "m"),
             planner=MithrilSavePlanner(compression_level=3))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"))
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "m"),
             planner=MithrilLoadPlanner())
    _assert_same(sd, back)
    assert _dir_bytes(tmp_path / "m") < _dir_bytes(tmp_path / "plain")


def test_load_planner_reads_plain_dcp(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"))
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "plain"),
             planner=MithrilLoadPlanner())
    _assert_same(sd, back)


def test_item_codec_detects_corruption() -> None:
    from mithril_async.errors import ChecksumMismatch, InvalidFormat

    small = torch.arange(10, dtype=torch.float32)
    raw = bytearray(encode_tensor(small))
    assert raw[:4] == b"MRAW"
    assert torch.equal(decode_item(bytes(raw), where="x", dtype=small.dtype,
                                   shape=small.shape), small)
    raw[-1] ^= 1
    with pytest.raises(ChecksumMismatch):
        decode_item(bytes(raw), where="x", dtype=small.dtype, shape=small.shape)
    big = bytearray(encode_tensor(torch.randn(4096)))
    big[len(big) // 2] ^= 0xFF
    with pytest.raises(InvalidFormat):
        decode_item(bytes(big), where="x")


_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from mithril_async.integrations.torch_dcp import MithrilLoadPlanner, MithrilSavePlanner
    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    full = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    rep = torch.randn(50, 40, generator=g)
    sd = {"sharded": distribute_tensor(full, mesh, [Shard(0)]), "rep": rep.clone(),
          "tiny": torch.tensor([1.5, 2.5]), "step": 7}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path),
             planner=MithrilSavePlanner(compression_level=3))
    back = {"sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
            "rep": torch.zeros_like(rep), "tiny": torch.zeros(2), "step": 0}
    dcp.load(back, storage_reader=dcp.FileSystemReader(path), planner=MithrilLoadPlanner())
    assert torch.equal(back["sharded"].full_tensor(), full), "sharded differs"
    assert torch.equal(back["rep"], rep) and torch.equal(back["tiny"], sd["tiny"])
    assert back["step"] == 7
    dist.barrier()
    dist.destroy_process_group()
    print("rank", rank, "ok")
""")


def test_two_gloo_ranks_roundtrip_and_reshard_to_one(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(ckpt),
                               str(tmp_path / "pg")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    # resharding: one process without a process group loads the sharded tensor whole
    g = torch.Generator().manual_seed(1)
    full = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    back = {"sharded": torch.zeros_like(full)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(ckpt), planner=MithrilLoadPlanner())
    assert torch.equal(back["sharded"], full)
    assert sorted(f.name for f in ckpt.iterdir() if f.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]


def test_async_save_uses_the_planner(tmp_path: Path) -> None:
    sd = {"w": torch.randn(256, 256), "step": 3}
    dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "a"),
                   planner=MithrilSavePlanner()).result()
    data = next((tmp_path / "a").glob("*.distcp")).read_bytes()
    assert b"MCKP" in data
    back = {"w": torch.zeros(256, 256), "step": 0}
    dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "a"),
             planner=MithrilLoadPlanner())
    assert torch.equal(back["w"], sd["w"]) and back["step"] == 3
