"""The seed-000 synchronous Compressor: save/load, delta chains, atomicity, missing bases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mithril_async.compressor import Compressor
from mithril_async.errors import ConfigError, KeyExists, KeyNotFound, MissingPrevious, UnsafeKey
from tests.codec._helpers import same_bits


def _steps(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g) * 0.02
    out = []
    for i in range(n):
        w = w + 1e-4 * torch.randn(4096, generator=g)
        out.append({"w": w.clone(), "b": w[:64].bfloat16(), "step": torch.tensor(i)})
    return out


def test_save_load_chain_and_meta(tmp_path: Path) -> None:
    c = Compressor(storage=f"local://{tmp_path}", delta_enabled=True, compression_level=3)
    steps = _steps(4)
    metas = [c.save(steps[0], key="step_0")]
    for i in range(1, 4):
        metas.append(c.save(steps[i], key=f"step_{i}", previous_key=f"step_{i - 1}"))
    assert metas[0].previous_key is None and metas[3].previous_key == "step_2"
    assert metas[0].original_size == sum(v.numel() * v.element_size() for v in steps[0].values())
    assert metas[2].compressed_size < metas[0].compressed_size and metas[2].ratio > 1
    for i in range(4):
        out = c.load(f"step_{i}")
        assert all(same_bits(out[k], v) for k, v in steps[i].items())
    assert c.keys() == [f"step_{i}" for i in range(4)]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp files left


def test_missing_or_replaced_base(tmp_path: Path) -> None:
    c = Compressor(storage=str(tmp_path))
    s = _steps(3)
    c.save(s[0], "a")
    c.save(s[1], "b", previous_key="a")
    c.save(s[2], "c", previous_key="b")
    c.save(s[0], "b2")
    (tmp_path / "b.mckp").replace(tmp_path / "b.bak")
    with pytest.raises(MissingPrevious, match="'b'"):
        c.load("c")
    (tmp_path / "b2.mckp").replace(tmp_path / "b.mckp")  # a different checkpoint under 'b'
    with pytest.raises(MissingPrevious, match="'b'"):
        c.load("c")
    with pytest.raises(KeyNotFound):
        c.save(s[0], "d", previous_key="nope")


def test_keys_and_overwrite_rules(tmp_path: Path) -> None:
    c = Compressor(storage=tmp_path, delta_enabled=False)
    s = _steps(2)
    c.save(s[0], "run1/x")
    m = c.save(s[1], "run1/y", previous_key="run1/x")
    assert m.previous_key is None  # delta disabled: stored in full
    assert same_bits(c.load("run1/y")["w"], s[1]["w"])
    with pytest.raises(KeyExists):
        c.save(s[1], "run1/x")
    c.save(s[1], "run1/x", overwrite=True)
    for bad in ("../x", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(UnsafeKey):
            c.save(s[0], bad)
    with pytest.raises(KeyNotFound):
        c.load("missing")
    c.delete("run1/x")
    assert c.keys() == ["run1/y"]
    with pytest.raises(ConfigError):
        Compressor(storage="s3://bucket/x")
