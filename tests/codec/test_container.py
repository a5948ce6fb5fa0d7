"""MCKP container: streaming writer, whole-blob and ranged readers, corruption handling."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import numpy as np
import pytest
import torch
import xxhash

from mithril_async.codec import container as C
from mithril_async.codec import container_read as R
from mithril_async.codec.chunk import CodecParams, encode_chunk
from mithril_async.codec.container import MckpWriter, TensorEntry
from mithril_async.codec.container_read import AsyncMckpRangeReader, MckpRangeReader, parse_blob
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.codec.state_dict import compress_state_dict, decompress_state_dict
from mithril_async.errors import ChecksumMismatch, InvalidFormat, UnknownFormatVersion
from tests.codec._helpers import det_tensor, same_bits

SMALL = CodecParams(chunk_bytes=256)


def _sd() -> dict[str, torch.Tensor]:
    return {"w.bf16": det_tensor("bfloat16", (8, 40), 1), "w.f32": det_tensor("float32", (50,), 2),
            "ids": torch.arange(30), "flag": torch.tensor(True)}


@pytest.fixture(scope="module")
def blob_and_prev() -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    prev = _sd()
    cur = {k: (v + 0.01 if v.is_floating_point() else v) for k, v in prev.items()}
    return compress_state_dict(cur, previous=prev, params=SMALL, step=7), cur, prev


def _regions(blob: bytes) -> dict[str, tuple[int, int]]:
    info = parse_blob(blob)
    first = min(r.offset for r in info.index.values())
    tr = R._parse_trailer(memoryview(blob)[-C.TRAILER_SIZE:], len(blob))
    blk = next(r for r in info.index.values() if r.tensor == 0)
    return {
        "preamble": (0, C.PREAMBLE.size), "header": (C.PREAMBLE.size, first),
        "block header": (blk.offset, blk.offset + C.BLOCK_FIXED.size),
        "payload": (blk.offset + C.BLOCK_FIXED.size + 30, blk.offset + blk.length),
        "index": (tr.index_offset, tr.index_offset + tr.index_length),
        "trailer": (len(blob) - C.TRAILER_SIZE, len(blob)),
    }


def test_writer_streams_in_any_order_and_ranged_reads() -> None:
    sd = _sd()
    entries, encs = [], []
    for name, t in sd.items():
        raw, dn, shape = tensor_bytes(t)
        e = TensorEntry.make(name, dn, shape, 64)
        entries.append(e)
        encs.append([encode_chunk(raw[o:o + n], dn, None, SMALL) for o, n in e.chunks])
    w = MckpWriter(entries, params=SMALL, training_step=3, metadata={"who": "test"})
    parts = [w.begin()]
    jobs = [(ti, ci) for ti in range(len(entries)) for ci in range(len(encs[ti]))]
    for ti, ci in reversed(jobs):
        parts.append(w.add(ti, ci, encs[ti][ci]))
        assert w.size == sum(map(len, parts))
    with pytest.raises(ValueError):
        w.add(0, 0, encs[0][0])
    parts.append(w.finish())
    blob = b"".join(parts)
    assert w.size == len(blob) and w.xxh64 == xxhash.xxh64_intdigest(blob)
    out = decompress_state_dict(blob)
    assert all(same_bits(out[k], v) for k, v in sd.items())
    info = parse_blob(blob)
    assert info.training_step == 3 and info.metadata == {"who": "test"}
    reads: list[tuple[int, int]] = []

    def rr(off: int, n: int) -> bytes:
        reads.append((off, n))
        return blob[off:off + n]

    r = MckpRangeReader(rr, len(blob))
    rinfo = r.open()
    assert len(reads) == 4 and rinfo.tensors == info.tensors
    meta, payload = r.read_block(1, 0)
    assert meta.raw_size == info.tensors[1].chunks[0][1] and len(payload) == meta.stored_size

    async def ar(off: int, n: int) -> bytes:
        return blob[off:off + n]

    async def go() -> int:
        a = AsyncMckpRangeReader(ar, len(blob))
        await a.open()
        m, _ = await a.read_block(0, 1)
        return m.raw_size

    assert asyncio.run(go()) == info.tensors[0].chunks[1][1]


def test_incomplete_blob_is_refused() -> None:
    e = TensorEntry.make("t", "float32", (100,), 128)
    w = MckpWriter([e], params=SMALL)
    w.begin()
    with pytest.raises(ValueError, match="missing"):
        w.finish()


def _outcomes(blob: bytes, cur: dict[str, torch.Tensor], prev: dict[str, torch.Tensor],
              ) -> tuple[bool, ...]:
    """Decode a (maybe corrupt) blob with and without the whole-blob hash and through the
    ranged reader; True where it raised a typed error.  Wrong data is never returned."""
    raised = []
    for verify in (True, False):
        try:
            out = decompress_state_dict(blob, previous=prev, verify=verify, threads=1)
        except InvalidFormat as e:
            assert str(e)
            raised.append(True)
            continue
        assert all(same_bits(out[k], v) for k, v in cur.items()), "wrong data returned"
        raised.append(False)
    try:
        r = MckpRangeReader(lambda o, k: blob[o:o + k], len(blob))
        info = r.open()
        for ti, ci in info.index:
            r.read_block(ti, ci)
        raised.append(False)
    except InvalidFormat:
        raised.append(True)
    return tuple(raised)


def test_every_single_bit_flip_is_caught(blob_and_prev: tuple) -> None:
    blob, cur, prev = blob_and_prev
    rng = np.random.default_rng(0)
    missed = 0
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        with_hash, without, ranged = _outcomes(bytes(bad), cur, prev)
        assert with_hash, pos
        # The ranged reader (per-block hashes) misses only a flip in the whole-blob hash.
        in_blob_hash = pos >= len(blob) - 8
        assert ranged != in_blob_hash, pos
        # verify=False trusts a whole-blob hash the caller checked, so payloads are not
        # rehashed: a flip in bits no decoder reads (e.g. a deflate stream's padding) decodes
        # to exactly the right bytes (_outcomes asserts that); any other flip still raises.
        if in_blob_hash:
            assert not without, pos
        else:
            missed += not without
    assert missed < len(blob) // 100


def test_errors_name_the_place(blob_and_prev: tuple) -> None:
    blob, _, prev = blob_and_prev
    expect = {"preamble": "header|magic|flags|version", "header": "header",
              "block header": "tensor 'w.bf16'", "payload": "tensor 'w.bf16'",
              "index": "index", "trailer": "trailer"}
    for region, (lo, hi) in _regions(blob).items():
        pos = (lo + hi) // 2
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(InvalidFormat, match=expect[region]):
            decompress_state_dict(bytes(bad), previous=prev, verify=False)
        with pytest.raises(ChecksumMismatch, match="whole blob"):
            decompress_state_dict(bytes(bad), previous=prev)


def test_truncation_zero_length_and_magic(blob_and_prev: tuple) -> None:
    blob, _, prev = blob_and_prev
    for n in [0, 1, 4, 15, 16, 17, 100, *range(len(blob) - 100, len(blob))]:
        for verify in (True, False):
            with pytest.raises(InvalidFormat):
                decompress_state_dict(blob[:n], previous=prev, verify=verify)
        with pytest.raises(InvalidFormat):
            MckpRangeReader(lambda o, k, b=blob[:n]: b[o:o + k], n).open()
    with pytest.raises(InvalidFormat, match="magic"):
        parse_blob(b"PK\x03\x04" + blob[4:])
    with pytest.raises(InvalidFormat, match="magic"):
        parse_blob(b"junk")


def _refresh(buf: bytearray) -> bytes:
    """Recompute trailer + whole-blob hashes after a deliberate, 'valid-looking' edit."""
    n = len(buf)
    t0 = n - C.TRAILER_SIZE
    f = list(C.TRAILER.unpack_from(buf, t0))
    hlen, ioff, ilen = f[0], f[1], f[2]
    f[4] = xxhash.xxh64_intdigest(bytes(buf[:C.PREAMBLE.size + hlen]))
    f[5] = xxhash.xxh64_intdigest(bytes(buf[ioff:ioff + ilen]))
    body = C.TRAILER.pack(*f)[:-8]
    buf[t0:t0 + C.TRAILER.size] = body + struct.pack("<Q", xxhash.xxh64_intdigest(body))
    buf[n - 8:] = struct.pack("<Q", xxhash.xxh64_intdigest(bytes(buf[:n - 8])))
    return bytes(buf)


def test_crafted_structural_lies_are_refused(blob_and_prev: tuple) -> None:
    blob, _, prev = blob_and_prev
    tr = R._parse_trailer(memoryview(blob)[-C.TRAILER_SIZE:], len(blob))
    # index entry pointing outside the blob
    for off, ln in [(len(blob) + 10, 100), (0, 100), (tr.index_offset - 10, 1 << 40)]:
        buf = bytearray(blob)
        ti, ci, _, _ = C.INDEX_ENTRY.unpack_from(buf, tr.index_offset)
        C.INDEX_ENTRY.pack_into(buf, tr.index_offset, ti, ci, off, ln)
        with pytest.raises(InvalidFormat, match="outside"):
            parse_blob(_refresh(buf))
    # a block header declaring an absurd raw size (with a valid header hash)
    info = parse_blob(blob)
    ref = info.index[(0, 0)]
    buf = bytearray(blob)
    fields = list(C.BLOCK_FIXED.unpack_from(buf, ref.offset))
    fields[6] = 1 << 50
    C.BLOCK_FIXED.pack_into(buf, ref.offset, *fields)
    hend = ref.offset + C.BLOCK_FIXED.size + fields[5] * C.PLANE.size
    buf[hend:hend + 8] = struct.pack("<Q", xxhash.xxh64_intdigest(bytes(buf[ref.offset:hend])))
    with pytest.raises(InvalidFormat, match="raw size"):
        decompress_state_dict(_refresh(buf), previous=prev)


def test_unknown_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "VERSION", 3)  # a future writer (an empty tensor: no blocks)
    blob = compress_state_dict({"e": torch.empty(0)})
    monkeypatch.undo()
    with pytest.raises(UnknownFormatVersion, match="version 3"):
        parse_blob(blob)
    with pytest.raises(UnknownFormatVersion):
        MckpRangeReader(lambda o, k: blob[o:o + k], len(blob)).open()
    today = compress_state_dict({"a": torch.ones(3)})
    assert parse_blob(today).version == C.VERSION == 2
    monkeypatch.setattr(R, "READ_VERSIONS", (1,))  # a reader from before version 2
    with pytest.raises(UnknownFormatVersion, match="version 2"):
        parse_blob(today)


def test_version_2_chunks_carry_xxh3_hashes_and_the_writer_refuses_others() -> None:
    """Version 2's one change: chunk raw/payload hashes are XXH3-64 (checked on decode)."""
    x = torch.arange(1000, dtype=torch.float32)
    blob = compress_state_dict({"x": x})
    info = parse_blob(blob)
    ref = info.index[(0, 0)]
    meta, payload = R.block_from_bytes(memoryview(blob)[ref.offset:ref.offset + ref.length],
                                       ref, info)
    assert meta.hash_version == 2
    assert meta.raw_xxh64 == xxhash.xxh3_64_intdigest(x.numpy().tobytes())
    assert meta.payload_xxh64 == xxhash.xxh3_64_intdigest(payload)
    enc = encode_chunk(x.numpy().view(np.uint8), "float32", None, CodecParams())
    old = dataclasses.replace(enc, meta=dataclasses.replace(enc.meta, hash_version=1))
    w = MckpWriter([TensorEntry.make("x", "float32", (1000,), CodecParams.chunk_bytes)],
                     params=CodecParams())
    w.begin()
    with pytest.raises(ValueError, match="version 1 hashes"):
        w.add(0, 0, old)
