"""Safetensors in (any file -> MCKP) and out (-> a file safe_open reads), bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mithril_async.errors import InvalidFormat
from mithril_async.integrations.safetensors_file import (
    compress_file,
    decompress_file,
    flatten_tensors,
    read_safetensors,
    write_output,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(300, 40, generator=g),
        "bf16": torch.randn(5000, generator=g).to(torch.bfloat16),
        "f16": torch.randn(64, 64, generator=g).half(),
        "f64": torch.randn(10, generator=g).double(),
        "i8": torch.randint(-100, 100, (999,), generator=g, dtype=torch.int8),
        "i64": torch.arange(4096),
        "bool": torch.rand(77, generator=g) > 0.3,
        "u8": torch.randint(0, 255, (3, 5), generator=g, dtype=torch.uint8),
        "f8": torch.randn(256, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_roundtrip_every_dtype_and_metadata(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    t = _tensors()
    save_file(t, str(src), metadata={"format": "pt", "k": "v"})
    res = compress_file(src, level=3)
    assert Path(res.dst).name == "m.mckp" and res.tensors == len(t)
    assert res.out_bytes < src.stat().st_size
    out = decompress_file(res.dst, tmp_path / "back.safetensors")
    with safe_open(out.dst, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        for k, v in t.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    back, meta = read_safetensors(out.dst)
    assert meta == {"format": "pt", "k": "v"}
    assert list(back) == list(read_safetensors(src)[0])


def test_pt_in_and_out(tmp_path: Path) -> None:
    tree = {"model": {"w": torch.ones(3, 3)}, "opt": [torch.zeros(2)], "step": 5}
    torch.save(tree, tmp_path / "ck.pt")
    res = compress_file(tmp_path / "ck.pt")
    decompress_file(res.dst, tmp_path / "flat.pt")
    flat = torch.load(tmp_path / "flat.pt", weights_only=True)
    assert set(flat) == {"model.w", "opt.0"}
    assert flatten_tensors(tree).keys() == flat.keys()
    with pytest.raises(InvalidFormat):
        write_output(tree, tmp_path / "x.txt")


def test_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(InvalidFormat):
        compress_file(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError):
        compress_file(tmp_path / "missing.safetensors")
