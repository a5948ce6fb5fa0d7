"""Per-tensor delta-or-full choice in delta versions, and restores that decode only the parts
of a base their deltas need."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mithril_async import (
    CheckpointManager,
    ChecksumMismatch,
    ConfigError,
    InvalidFormat,
    TensorDict,
    parse_config,
)
from mithril_async.codec import compress_state_dict, decompress_state_dict, read_info
from mithril_async.codec.chunk import CodecParams
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.restore import fresh
from mithril_async.save import xor_choice as choice

G = torch.Generator().manual_seed(0)


def _w(n: int = 1 << 16, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(n, generator=G) * 0.02).to(dtype)


def _pays(a: torch.Tensor, b: torch.Tensor, gain: float) -> bool:
    raw, name, _ = tensor_bytes(a)
    return choice.delta_pays(raw, tensor_bytes(b)[0], name, a.element_size(), CodecParams(),
                             gain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_small_drift_pays_and_a_rewritten_tensor_does_not(dtype: torch.dtype) -> None:
    base = _w(dtype=dtype)
    drift = (base.float() + _w() * 1e-3).to(dtype)  # a weight after one optimizer step
    fresh = _w(dtype=dtype)  # same distribution, every value new (what Adam moments look like)
    assert _pays(drift, base, 0.0) and _pays(drift, base, 0.1)
    assert not _pays(fresh, base, 0.0)


def test_tiny_tensors_are_full_and_integers_keep_the_delta() -> None:
    small = _w(choice.TINY_BYTES // 4 - 1)
    assert not _pays(small, small.clone(), 0.0)
    ints = torch.arange(1 << 14, dtype=torch.int64)
    assert _pays(ints + 1, ints, 0.5)  # zstd codes integer deltas; the estimate is not used


def test_estimate_tracks_the_real_coder() -> None:
    """The order-0 estimate of a full encoding is within 5 % of what the codec stores."""
    for dtype in (torch.float32, torch.bfloat16):
        t = _w(1 << 18, dtype)
        raw, name, _ = tensor_bytes(t)
        sample = choice._sample(raw, t.element_size())
        assert sample.size == choice.SAMPLE_ELEMENTS * t.element_size()
        est = choice.estimated_bytes(sample, name, None, CodecParams()) * raw.size / sample.size
        real = len(compress_state_dict({"t": t}, threads=1))
        assert abs(est - real) / real < 0.05, (dtype, est, real)


def test_delta_min_gain_config() -> None:
    base = "[checkpointing]\nruns_path = 'r'\n[checkpointing.compression]\ndelta = true\n"
    assert parse_config(base).checkpointing.compression.effective_delta_min_gain == 0.0
    kf = parse_config(base + 'delta_base = "keyframe"\n').checkpointing.compression
    assert kf.effective_delta_min_gain == 0.1
    assert parse_config(base + "delta_min_gain = 0.3\n").checkpointing.compression \
        .effective_delta_min_gain == 0.3
    with pytest.raises(ConfigError, match="delta_min_gain"):
        parse_config(base + "delta_min_gain = 1.0\n")


def _versions(tmp_path: Path, n: int, extra: str = "") -> tuple[list[dict[str, torch.Tensor]],
                                                                  dict[str, torch.Tensor]]:
    """n saves of a state with a drifting weight and a tensor rewritten every step."""
    live = {"w": _w(), "moment": _w().abs()}
    held = TensorDict({k: v.clone() for k, v in live.items()})
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n'
                       "[checkpointing.compression]\ndelta = true\nkeyframe_interval = 8\n"
                       + extra)
    seen = []
    with CheckpointManager(cfg, {"model": held}) as m:
        for step in range(1, n + 1):
            held.tensors["w"].add_(_w() * 1e-3)
            held.tensors["moment"].copy_(_w().abs())
            seen.append({k: v.clone() for k, v in held.tensors.items()})
            m.save_nowait(step).result()
    return seen, held.tensors


def _blob_bases(tmp_path: Path, v: int) -> dict[str, bool]:
    d = tmp_path / "runs" / "r" / "versions" / f"v{v:06d}"
    info = read_info((d / "model.mckp").read_bytes())
    return {t.name: t.base_xxh64 is not None for t in info.tensors}


@pytest.mark.parametrize("policy", ["previous", "keyframe"])
def test_delta_versions_store_what_does_not_pay_in_full(tmp_path: Path, policy: str) -> None:
    seen, held = _versions(tmp_path, 4, f'delta_base = "{policy}"\n')
    assert _blob_bases(tmp_path, 1) == {"w": False, "moment": False}
    for v in (2, 3, 4):
        assert _blob_bases(tmp_path, v) == {"w": True, "moment": False}, v
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n')
    with CheckpointManager(cfg, {"model": TensorDict(held)}) as m:
        for v in (4, 2, 3, 1):
            m.restore_sync(v)
            assert all(torch.equal(held[k], seen[v - 1][k]) for k in held), v


def test_a_version_with_nothing_worth_a_delta_has_no_base(tmp_path: Path) -> None:
    live = TensorDict({"moment": _w()})
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n'
                       "[checkpointing.compression]\ndelta = true\n")
    with CheckpointManager(cfg, {"model": live}) as m:
        for step in (1, 2, 3):
            live.tensors["moment"].copy_(_w())
            m.save_nowait(step).result()
    for v in (1, 2, 3):
        man = json.loads((tmp_path / "runs" / "r" / "versions" / f"v{v:06d}" /
                          "manifest.json").read_text())
        assert man["model"]["base"] is None


def test_decompress_only_some_tensors() -> None:
    sd = {"a": _w(1000), "b": torch.arange(7), "c": _w(10, torch.bfloat16)}
    blob = compress_state_dict(sd)
    out = decompress_state_dict(blob, only={"a", "c", "not-there"})
    assert set(out) == {"a", "c"}
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["c"], sd["c"])
    prev = {k: v.clone() for k, v in sd.items()}
    cur = {"a": sd["a"] + 1, "b": sd["b"], "c": sd["c"]}
    delta = compress_state_dict(cur, previous=prev)
    only_b = decompress_state_dict(delta, previous={"b": prev["b"]}, only={"b"})
    assert set(only_b) == {"b"} and torch.equal(only_b["b"], cur["b"])  # no other base needed


def test_restore_asks_each_base_only_for_what_its_deltas_need(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """v3 (keyframe-based) XORs "w" against v1 and stores "moment" in full: restoring v3
    decodes v1's "w" and nothing else of v1."""
    seen, held = _versions(tmp_path, 3, 'delta_base = "keyframe"\n')
    asked: list[tuple[str, Any]] = []
    real = fresh.decode_tensors

    def spy(info: Any, block_bytes: Any, **kw: Any) -> dict[str, Any]:
        asked.append((info.training_step, kw.get("only")))
        return real(info, block_bytes, **kw)

    monkeypatch.setattr(fresh, "decode_tensors", spy)
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n')
    with CheckpointManager(cfg, {"model": TensorDict(held)}) as m:
        assert m.restore_sync(3) == 3
    assert all(torch.equal(held[k], seen[2][k]) for k in held)
    assert sorted(asked, key=lambda a: a[0]) == [(1, frozenset({"w"})), (3, None)]
    assert np.array_equal(tensor_bytes(held["moment"])[0], tensor_bytes(seen[2]["moment"])[0])


def _keyframe_state(tmp_path: Path) -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
    """v1 keyframe holding a small drifting "w" and a big "moment" rewritten every step (so
    v2's delta needs only "w" of v1: a small part of v1's blob)."""
    held = TensorDict({"w": _w(1 << 12), "moment": _w(1 << 18)})
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n'
                       '[checkpointing.compression]\ndelta = true\ndelta_base = "keyframe"\n')
    seen = []
    with CheckpointManager(cfg, {"model": held}) as m:
        for step in (1, 2):
            held.tensors["w"].add_(_w(1 << 12) * 1e-3)
            held.tensors["moment"].copy_(_w(1 << 18))
            seen.append({k: v.clone() for k, v in held.tensors.items()})
            m.save_nowait(step).result()
    assert _blob_bases(tmp_path, 2) == {"w": True, "moment": False}
    return seen, held.tensors


def _block_of(blob_path: Path, name: str) -> Any:
    info = read_info(blob_path.read_bytes())
    ti = next(i for i, t in enumerate(info.tensors) if t.name == name)
    return next(r for r in info.index.values() if r.tensor == ti)


def test_a_base_is_read_by_ranges_when_little_of_it_is_needed(tmp_path: Path) -> None:
    """Restoring v2 reads only v1's header, index and "w" blocks: a flip in v1's "moment"
    (not needed) goes unnoticed by this restore (``mithril verify`` still finds it), a flip in
    its "w" payload is a ChecksumMismatch, never wrong weights."""
    seen, held = _keyframe_state(tmp_path)
    v1 = tmp_path / "runs" / "r" / "versions" / "v000001" / "model.mckp"
    good = v1.read_bytes()
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n')
    moment, w = _block_of(v1, "moment"), _block_of(v1, "w")
    bad = bytearray(good)
    bad[moment.offset + moment.length - 3] ^= 0x10
    v1.write_bytes(bytes(bad))
    with CheckpointManager(cfg, {"model": TensorDict(held)}) as m:
        assert m.restore_sync(2) == 2
        assert all(torch.equal(held[k], seen[1][k]) for k in held)
        with pytest.raises(ChecksumMismatch):
            m.restore_sync(1, verify="whole")  # a whole-blob read checks every byte
    bad = bytearray(good)
    bad[w.offset + w.length - 3] ^= 0x10
    v1.write_bytes(bytes(bad))
    with CheckpointManager(cfg, {"model": TensorDict(held)}) as m, \
            pytest.raises(ChecksumMismatch):
        m.restore_sync(2)


def test_read_partial_merges_adjacent_blocks_and_declines_big_parts(tmp_path: Path) -> None:
    from mithril_async.restore import sources
    from mithril_async.restore.windows import group_windows
    from mithril_async.storage.local import LocalStore

    sd = {"a": _w(1 << 10), "b": _w(1 << 18), "c": _w(1 << 10)}
    blob = compress_state_dict(sd, chunk_bytes=1 << 12)  # "a": one block, "c": one block
    store = LocalStore(tmp_path)

    async def go(names: set[str]) -> Any:
        await store.put("x.mckp", blob)
        return await sources.read_partial(store, "x.mckp", len(blob), names)

    got = asyncio.run(go({"a", "c"}))
    assert got is not None
    info, block_bytes = got
    out = fresh.decode_tensors(info, block_bytes, only={"a", "c"})
    assert set(out) == {"a", "c"} and all(torch.equal(out[k], sd[k]) for k in out)
    assert asyncio.run(go({"b"})) is None  # most of the blob: read whole
    refs = sorted(info.index.values(), key=lambda r: r.offset)[:3]
    assert [span for span, _ in group_windows(refs, len(blob))] == [
        (refs[0].offset, sum(r.length for r in refs))]


def test_a_chain_of_bases_that_loops_is_refused_not_hung(tmp_path: Path) -> None:
    """Damaged manifests whose bases point at each other (v2 -> v3 -> v2): InvalidFormat
    naming the loop, where a lock per blob could otherwise wait on itself forever."""
    _, held = _versions(tmp_path, 3)
    vdir = tmp_path / "runs" / "r" / "versions"
    mans = {v: json.loads((vdir / f"v{v:06d}" / "manifest.json").read_text()) for v in (2, 3)}
    link = {v: {"version_id": f"v{v:06d}", "key": mans[v]["model"]["key"],
                "xxh64": mans[v]["model"]["xxh64"]} for v in (2, 3)}
    mans[2]["model"]["base"], mans[3]["model"]["base"] = link[3], link[2]
    for v, man in mans.items():
        (vdir / f"v{v:06d}" / "manifest.json").write_text(json.dumps(man))
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n')
    with CheckpointManager(cfg, {"model": TensorDict(held)}) as m, \
            pytest.raises(InvalidFormat, match="loops"):
        m.restore_sync(2)
