"""DCP planners: exact roundtrips in one process, across 2 real gloo ranks, and resharding."""

from __future__ import annotations

import inspect
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from mithril_async.integrations.torch_dcp import (
    MithrilLoadPlanner,
    MithrilSavePlanner,
    dcp_to_torch_save,
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
    from mithril_async.errors import InvalidFormat

    big = bytearray(encode_tensor(torch.randn(4096)))
    assert big[:4] == b"PK\x03\x04"  # a genuine torch.save file
    assert torch.equal(decode_item(bytes(big), where="x"),
                       torch.load(io.BytesIO(bytes(big)), weights_only=True))
    big[len(big) // 2] ^= 0xFF
    with pytest.raises(InvalidFormat):
        decode_item(bytes(big), where="x")


def test_items_of_older_versions_still_decode() -> None:
    """Bare MCKP items and MRAW (+ xxh64) tiny items, as versions before the torch.save
    wrapper wrote them."""
    import xxhash

    from mithril_async.codec.state_dict import compress_state_dict
    from mithril_async.errors import ChecksumMismatch

    t = torch.randn(3000)
    assert torch.equal(decode_item(compress_state_dict({"t": t}), where="x"), t)
    small = torch.arange(10, dtype=torch.float32)
    raw = bytearray(b"MRAW" + xxhash.xxh64_intdigest(small.numpy().tobytes()).to_bytes(8, "little")
                    + small.numpy().tobytes())
    assert torch.equal(decode_item(bytes(raw), where="x", dtype=small.dtype,
                                   shape=small.shape), small)
    raw[-1] ^= 1
    with pytest.raises(ChecksumMismatch):
        decode_item(bytes(raw), where="x", dtype=small.dtype, shape=small.shape)


def test_constructors_take_the_default_planners_positional_arguments() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    for ours, theirs in ((MithrilSavePlanner, DefaultSavePlanner),
                         (MithrilLoadPlanner, DefaultLoadPlanner)):
        mine = [n for n in inspect.signature(ours).parameters.values()
                if n.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        torch_ = [n for n in inspect.signature(theirs).parameters.values()
                  if n.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert [(p.name, p.default) for p in mine] == [(p.name, p.default) for p in torch_]
    sp = MithrilSavePlanner(False, False)
    assert sp.flatten_state_dict is False and sp.flatten_sharded_tensors is False
    lp = MithrilLoadPlanner(True, True, True)
    assert lp.allow_partial_load is True
    assert MithrilSavePlanner(compression_level=7).params.level == 7
    with pytest.raises(TypeError, match="compression_level=3"):
        MithrilSavePlanner(3)  # type: ignore[arg-type]  # a level passed positionally
    with pytest.raises(TypeError):
        MithrilSavePlanner(True, compression_level=3, bogus=1)  # type: ignore[call-arg]


def test_positional_flatten_false_and_partial_load(tmp_path: Path) -> None:
    """``MithrilSavePlanner(False)`` is flatten_state_dict=False: the checkpoint has the same
    keys as DCP's ``DefaultSavePlanner(False)`` writes (a nested dict is one pickled item)."""
    from torch.distributed.checkpoint import FileSystemReader

    w = torch.randn(64, 64)
    sd = {"w": w, "model": {"v": torch.randn(8)}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "c"),
             planner=MithrilSavePlanner(False))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "d"),
             planner=DefaultSavePlanner(False))
    ours = FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata
    theirs = FileSystemReader(tmp_path / "d").read_metadata().state_dict_metadata
    assert set(ours) == set(theirs) == {"w", "model"}
    back = {"w": torch.zeros(64, 64), "not_saved": torch.zeros(2)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "c"),
             planner=MithrilLoadPlanner(False, True, True))  # allow_partial_load
    assert torch.equal(back["w"], w)
    with pytest.raises(CheckpointException, match="not_saved"):
        dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "c"),
                 planner=MithrilLoadPlanner(False))


_DEFAULT_READER = textwrap.dedent("""
    # a fresh process that never imports mithril_async itself: DCP's defaults read the files
    import sys, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    ckpt, out = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(256, 64, generator=g).to(torch.bfloat16),
          "big": torch.randn(300, 100, generator=g), "tiny": torch.arange(3.0), "step": 0}
    dcp.load(sd, checkpoint_id=ckpt)                      # the default load planner
    assert "mithril_async" in sys.modules                 # imported by unpickling .metadata
    dcp_to_torch_save(ckpt, out)                          # torch's own converter
    torch.save(sd, out + ".loaded")
    print("ok")
""")


def test_dcp_default_planner_and_torch_converter_read_ours(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(256, 64, generator=g).to(torch.bfloat16),
          "big": torch.randn(300, 100, generator=g), "tiny": torch.arange(3.0), "step": 9}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "c"),
             planner=MithrilSavePlanner())
    assert b"MCKP" in next((tmp_path / "c").glob("*.distcp")).read_bytes()
    script = tmp_path / "reader.py"
    script.write_text(_DEFAULT_READER)
    out = tmp_path / "full.pt"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "c"), str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = torch.load(str(out) + ".loaded", weights_only=True)
    converted = torch.load(out, weights_only=True)  # plain tensors: no mithril needed
    _assert_same(sd, loaded)
    _assert_same(sd, converted)


class _OldLayoutPlanner(MithrilSavePlanner):
    """Writes items as versions before the torch.save wrapper did: a bare MCKP blob, and
    plain DCP metadata (nothing to hook into)."""

    def create_global_plan(self, all_plans: Any) -> Any:
        plans, md = DefaultSavePlanner.create_global_plan(self, all_plans)
        return plans, md

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index not in self._compressed:
            return super().resolve_data(write_item)
        from mithril_async.codec.state_dict import compress_state_dict

        return io.BytesIO(compress_state_dict({"t": self.lookup_object(write_item.index)}))


def test_our_converter_reads_old_layout_and_sharded_checkpoints(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as torch_convert

    sd = {"model": {"w": torch.randn(128, 64), "b": torch.randn(5)}, "step": 2}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "old"),
             planner=_OldLayoutPlanner())
    dcp_to_torch_save(tmp_path / "old", tmp_path / "old.pt")
    _assert_same(sd, torch.load(tmp_path / "old.pt", weights_only=True))
    # torch's converter cannot read bare MCKP items (documented): it fails, loudly
    with pytest.raises(CheckpointException, match=r"Weights only load failed|Unpickl"):
        torch_convert(tmp_path / "old", tmp_path / "old-torch.pt")


def test_hostile_item_call_is_refused() -> None:
    """An item whose pickle calls our decoder with anything but an MCKP payload."""
    from mithril_async.errors import InvalidFormat
    from mithril_async.integrations.torch_dcp import mithril_compressed_tensor

    with pytest.raises(InvalidFormat, match="layout"):
        mithril_compressed_tensor(torch.zeros(8, dtype=torch.uint8), 99)
    with pytest.raises(InvalidFormat, match="uint8"):
        mithril_compressed_tensor(torch.zeros(8), 1)
    with pytest.raises(InvalidFormat, match="MCKP"):
        mithril_compressed_tensor(torch.zeros(8, dtype=torch.uint8), 1)


def test_constant_tensor_in_big_chunks_stays_within_the_decode_bound(tmp_path: Path) -> None:
    """Where no metadata is at hand an item may decode to at most MAX_ITEM_RATIO times its
    blob; a constant tensor coded in 64 MiB chunks would exceed it, so the planner codes that
    item in smaller chunks, and DCP's default planner (the bounded path) still reads it."""
    from mithril_async.integrations.torch_dcp import MAX_ITEM_RATIO

    z = torch.zeros(40 << 20, dtype=torch.uint8)
    dcp.save({"z": z}, storage_writer=dcp.FileSystemWriter(tmp_path / "c"),
             planner=MithrilSavePlanner(chunk_mib=64))
    item = next((tmp_path / "c").glob("*.distcp")).read_bytes()
    assert z.numel() <= len(item) * MAX_ITEM_RATIO < 64 * z.numel()  # small, yet within
    back = {"z": torch.ones_like(z)}
    dcp.load(back, checkpoint_id=tmp_path / "c")  # DCP's default planner
    assert not back["z"].any()
    assert torch.equal(torch.load(io.BytesIO(encode_tensor(torch.ones(3000))), weights_only=True),
                       torch.ones(3000))  # an ordinary item is coded once, as before


def test_item_must_hold_what_the_metadata_says() -> None:
    """With the chunk's dtype and shape at hand, an item holding anything else is refused
    before decoding (whichever layout); without them the ratio bound applies."""
    from mithril_async.codec.state_dict import compress_state_dict
    from mithril_async.errors import InvalidFormat

    t = torch.randn(64, 64)
    for data in (encode_tensor(t), compress_state_dict({"t": t})):
        assert torch.equal(decode_item(data, where="w", dtype=torch.float32, shape=t.shape), t)
        with pytest.raises(InvalidFormat, match=r"w: the item declares float32 \[64, 64\], the "
                                                r"checkpoint's metadata says float32 \[32, 64\]"):
            decode_item(data, where="w", dtype=torch.float32, shape=torch.Size([32, 64]))
        with pytest.raises(InvalidFormat, match="metadata says bfloat16"):
            decode_item(data, where="w", dtype=torch.bfloat16, shape=t.shape)


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
