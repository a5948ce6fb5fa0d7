"""The transform registry: ids pinned to docs/FORMAT.md, every transform round-trips, the
writer's choices unchanged, hostile ids and widths refused."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from mithril_async.codec import container as C
from mithril_async.codec import container_read as R
from mithril_async.codec.chunk import (
    CHUNK_HASH_VERSION,
    DELTA_BIT,
    ChunkMeta,
    CodecParams,
    choose_transform,
    chunk_hasher,
    decode_chunk,
    plane_sizes,
    transform_bytes,
    transform_for,
)
from mithril_async.codec.dtypes import DTYPES
from mithril_async.codec.entropy import PlaneMethod
from mithril_async.codec.state_dict import compress_state_dict
from mithril_async.codec.transforms import CHOICE_ORDER, REGISTRY, ChunkTransform, Transform
from mithril_async.errors import InvalidFormat

FORMAT_MD = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"

#: Ids already written into blobs: they must keep their meaning forever (append only).
WRITTEN_IDS = {0: "NONE", 1: "GROUP", 2: "EXP_BF16", 3: "EXP_FP32"}

TRANSFORMS = sorted(REGISTRY.values(), key=lambda t: t.id)


def _format_md_table() -> dict[int, tuple[str, range]]:
    """``{id: (name, widths)}`` from the transform table of docs/FORMAT.md."""
    text = FORMAT_MD.read_text()
    section = text[text.index("**Transforms**"):text.index("**Plane methods**")]
    rows = re.findall(r"^\| (\d+) +\| (\w+) +\| (\d+)(?:\.\.(\d+))? +\|", section, re.M)
    assert rows, "no transform table in docs/FORMAT.md"
    return {int(i): (name, range(int(lo), int(hi or lo) + 1)) for i, name, lo, hi in rows}


def test_registry_matches_format_md_and_the_id_enum() -> None:
    assert {i: (t.name, t.widths) for i, t in REGISTRY.items()} == _format_md_table()
    assert {m.value: m.name for m in Transform} == {i: t.name for i, t in REGISTRY.items()}
    assert all(REGISTRY[i].name == name for i, name in WRITTEN_IDS.items())
    assert all(0 <= i < DELTA_BIT and t.id == i for i, t in REGISTRY.items())
    assert sorted(CHOICE_ORDER, key=lambda t: t.id) == TRANSFORMS
    assert CHOICE_ORDER[-1] is REGISTRY[Transform.NONE]  # takes what nothing else does
    assert all(isinstance(t, ChunkTransform) for t in TRANSFORMS)


def _forged_raw_block(tr: ChunkTransform, width: int, src: np.ndarray,
                      base: np.ndarray | None) -> tuple[ChunkMeta, bytes]:
    """A chunk as ``tr`` lays it out, every plane stored RAW (no plane coder involved)."""
    planes = transform_bytes(src, tr.id, width, base)
    assert planes.size == src.size
    sizes = plane_sizes(tr.id, width, src.size)
    assert sum(sizes) == src.size and len(sizes) == tr.planes(width) + (src.size % width > 0)
    h = chunk_hasher(CHUNK_HASH_VERSION)
    payload = planes.tobytes()
    meta = ChunkMeta(tr.id | (DELTA_BIT if base is not None else 0), width, src.size,
                     h(src.data), h(payload), tuple((int(PlaneMethod.RAW), n) for n in sizes))
    return meta, payload


def _roundtrips(tr: ChunkTransform, width: int, src: np.ndarray) -> None:
    base = np.random.default_rng(src.size).integers(0, 256, src.size, dtype=np.uint8)
    for b in (None, base):
        keep = src.copy()
        meta, payload = _forged_raw_block(tr, width, src, b)
        out = np.full(src.size, 0xA5, np.uint8)
        decode_chunk(payload, meta, b, out, where=tr.name)
        assert np.array_equal(out, src), (tr.name, width, b is not None)
        out[:] = 0x5A
        tr.inverse(tr.forward(src, width, b, None), width, b, out)  # the inverse even where
        assert np.array_equal(out, src)  # decode_chunk skips it (identity without a base)
        assert np.array_equal(src, keep)  # inputs are never written to


#: (transform, dtype, width) for every dtype a transform claims (would be chosen for, all
#: transforms enabled, on a big chunk, were it first in the choice order)
CLAIMS = [(tr, name, w) for tr in TRANSFORMS for name, info in sorted(DTYPES.items())
          if (w := tr.choose(info, 1 << 16, CodecParams())) is not None]


@pytest.mark.parametrize(("tr", "dtype", "width"), CLAIMS,
                         ids=[f"{t.name}-{d}" for t, d, _ in CLAIMS])
def test_every_transform_roundtrips_on_every_dtype_it_claims(tr: ChunkTransform, dtype: str,
                                                             width: int) -> None:
    assert width in tr.widths
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 64, 1001):
        _roundtrips(tr, width, rng.integers(0, 256, n * DTYPES[dtype].itemsize, dtype=np.uint8))


def test_every_transform_claims_a_dtype() -> None:
    assert {t.id for t, _, _ in CLAIMS} == set(REGISTRY)


@pytest.mark.parametrize("tr", TRANSFORMS, ids=lambda t: t.name)
def test_every_width_a_reader_accepts_roundtrips(tr: ChunkTransform) -> None:
    rng = np.random.default_rng(8)
    for width in tr.widths:
        for size in {0, width, 37 * width, 37 * width + width // 2}:  # a tail plane too
            _roundtrips(tr, width, rng.integers(0, 256, size, dtype=np.uint8))


def test_writer_choices_are_unchanged() -> None:
    """The transform and width per dtype that golden-file-compatible writers have chosen."""
    grouped = {"float64": 8, "float16": 2, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
               "uint32": 4, "uint64": 8, "complex32": 2, "complex64": 4, "complex128": 8}
    exp = {"bfloat16": (Transform.EXP_BF16, 2), "float32": (Transform.EXP_FP32, 4)}
    for name, info in DTYPES.items():
        big = 1 << 20
        want = exp.get(name) or ((Transform.GROUP, grouped[name]) if name in grouped
                                 else (Transform.NONE, 1))
        assert choose_transform(name, big, CodecParams())[:2] == want, name
        no_exp = (Transform.GROUP, info.itemsize) if name in exp else want
        assert choose_transform(name, big, CodecParams(exponent_planes=False))[:2] == no_exp
        assert choose_transform(name, big, CodecParams(byte_grouping=False))[:2] == (
            Transform.NONE, 1)
        mode = "float" if info.kind in ("float", "complex") else "zstd"
        assert choose_transform(name, big, CodecParams())[2] == mode
        assert choose_transform(name, big, CodecParams(entropy="zstd"))[2] == "zstd"
    # size thresholds: exponent planes from 16 bytes, grouping from two groups
    assert choose_transform("bfloat16", 14, CodecParams())[:2] == (Transform.GROUP, 2)
    assert choose_transform("bfloat16", 2, CodecParams())[:2] == (Transform.NONE, 1)
    assert choose_transform("float32", 16, CodecParams())[:2] == (Transform.EXP_FP32, 4)
    assert choose_transform("float32", 12, CodecParams())[:2] == (Transform.GROUP, 4)
    assert choose_transform("float64", 8, CodecParams())[:2] == (Transform.NONE, 1)
    assert choose_transform("complex64", 8, CodecParams())[:2] == (Transform.GROUP, 4)


UNKNOWN_IDS = [i for i in range(0x80) if i not in REGISTRY]


def test_hostile_transform_bytes_and_widths_are_refused() -> None:
    meta, payload = _forged_raw_block(REGISTRY[Transform.GROUP], 4, np.arange(64, dtype=np.uint8),
                                      None)
    out = np.empty(64, np.uint8)
    for t in [*UNKNOWN_IDS, *(i | DELTA_BIT for i in UNKNOWN_IDS), 0x100, 0x101, -1]:
        bad = ChunkMeta(t, meta.width, 64, meta.raw_xxh64, meta.payload_xxh64, meta.planes)
        with pytest.raises(InvalidFormat, match=f"blk: unknown transform {t}$"):
            decode_chunk(payload, bad, None, out, where="blk")
        with pytest.raises(InvalidFormat, match="unknown transform"):
            transform_for(t)
    for tr in TRANSFORMS:
        for width in (0, 1, 2, 4, 16, 17, 255):
            if width in tr.widths:
                continue
            n = max(width, 1)
            bad = ChunkMeta(tr.id, width, 64, 0, 0, ((0, 64 // n),) * n)
            with pytest.raises(InvalidFormat, match=f"width {width} invalid for {tr.name}"):
                decode_chunk(b"\0" * (64 // n * n), bad, None, out, where="blk",
                             verify_payload=False)


def test_block_reader_refuses_unregistered_transform_ids() -> None:
    blob = compress_state_dict({"w": torch.arange(64, dtype=torch.float32)})
    info = R.parse_blob(blob)
    ref = info.index[(0, 0)]
    good = bytearray(blob[ref.offset:ref.offset + ref.length])
    assert R.block_from_bytes(bytes(good), ref, info)[0].transform == Transform.EXP_FP32
    nplanes = C.BLOCK_FIXED.unpack_from(good, 0)[5]
    hend = C.BLOCK_FIXED.size + nplanes * C.PLANE.size
    for t in [*UNKNOWN_IDS, DELTA_BIT | Transform.EXP_FP32]:
        buf = bytearray(good)
        buf[12] = t
        buf[hend:hend + 8] = struct.pack("<Q", xxhash.xxh64_intdigest(bytes(buf[:hend])))
        msg = "delta flag" if t & DELTA_BIT else f"unknown transform {t}$"
        with pytest.raises(InvalidFormat, match=msg):
            R.block_from_bytes(bytes(buf), ref, info)
