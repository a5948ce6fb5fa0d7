"""Issue 8.10: the MCKP and HPΔKV readers, fed random bytes, mutated valid blobs (with their
checksums recomputed so the mutation reaches the parser behind them) and structurally edited
headers, raise typed errors only (subclasses of ``MithrilError``) - never another exception,
a crash or a hang (a hang trips the per-test pytest timeout; no per-example wall-clock
deadline, which a loaded machine could miss without anything being wrong).
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mithril_async.codec.container import HASH, PREAMBLE, TRAILER, TRAILER_SIZE
from mithril_async.codec.container_read import MckpRangeReader, parse_blob
from mithril_async.codec.state_dict import compress_state_dict, decompress_state_dict
from mithril_async.errors import MithrilError
from mithril_async.lossy.hpdkv import pack_residuals, unpack_residuals
from tests.faults._common import scale

EXAMPLES = scale(120, 3000)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COUNTS: dict[str, int] = {}


def _base_blobs() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10, dtype=torch.int16),
         "h": torch.randn(300, generator=g).to(torch.bfloat16), "e": torch.zeros(0)}
    b = {k: (v + 1 if v.is_floating_point() else v) for k, v in a.items()}
    full = compress_state_dict(a, chunk_bytes=1024, step=3, metadata={"x": "y"})
    delta = compress_state_dict(b, previous=a, chunk_bytes=2048, level=1)
    plain = compress_state_dict({"u8": torch.arange(256, dtype=torch.uint8)},
                                byte_grouping=False)
    return [full, delta, plain]


BLOBS = _base_blobs()
PREVIOUS = {"w": torch.zeros(64, 32)}


def _read_all(blob: bytes) -> None:
    """Every reader entry point over one blob; only typed errors may escape."""
    for verify in (True, False):
        with contextlib.suppress(MithrilError):
            parse_blob(blob, verify=verify)
    for prev in (None, PREVIOUS):
        with contextlib.suppress(MithrilError):
            decompress_state_dict(blob, previous=prev, verify=False, threads=1)
    reader = MckpRangeReader(lambda off, n: blob[off:off + n], len(blob))
    with contextlib.suppress(MithrilError):
        info = reader.open()
        for key in info.index:
            with contextlib.suppress(MithrilError):
                reader.read_block(*key)


def _rehash(blob: bytearray) -> bytes:
    """Recompute the header, index, trailer and whole-blob hashes of a (mutated) blob, so
    the parser behind the checksums sees the mutation. Works only while the trailer's
    lengths still make sense; otherwise the blob is returned as is."""
    n = len(blob)
    if n < PREAMBLE.size + TRAILER_SIZE:
        return bytes(blob)
    tb = bytes(blob[n - TRAILER_SIZE:n - TRAILER_SIZE + TRAILER.size])
    hlen, ioff, ilen, icount, _hx, _ix, total, version, magic, _tx = TRAILER.unpack(tb)
    if not (PREAMBLE.size + hlen <= n and ioff + ilen <= n):
        return bytes(blob)
    hx = xxhash.xxh64_intdigest(bytes(blob[:PREAMBLE.size + hlen]))
    ix = xxhash.xxh64_intdigest(bytes(blob[ioff:ioff + ilen]))
    body = TRAILER.pack(hlen, ioff, ilen, icount, hx, ix, total, version, magic, 0)[:-HASH.size]
    trailer = body + HASH.pack(xxhash.xxh64_intdigest(body))
    out = bytearray(blob[:n - TRAILER_SIZE]) + trailer
    return bytes(out + HASH.pack(xxhash.xxh64_intdigest(bytes(out))))


def _count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


@FUZZ
@given(st.binary(max_size=2048))
def test_mckp_random_bytes(data: bytes) -> None:
    _count("mckp-random")
    _read_all(data)
    _read_all(b"MCKP" + data)


Mutation = tuple[str, int, int]
MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "del", "dup"]),
                               st.integers(0, 1 << 20), st.integers(0, 255)),
                     min_size=1, max_size=4)


def _mutate(blob: bytes, muts: list[Mutation]) -> bytearray:
    out = bytearray(blob)
    for kind, pos, val in muts:
        if not out:
            break
        i = pos % len(out)
        if kind == "flip":
            out[i] ^= 1 << (val % 8)
        elif kind == "set":
            out[i] = val
        elif kind == "cut":
            del out[i:]
        elif kind == "del":
            del out[i:i + 1 + val % 16]
        else:
            out[i:i] = out[i:i + 1 + val % 16]
    return out


@FUZZ
@given(st.integers(0, len(BLOBS) - 1), MUTATIONS, st.booleans())
def test_mckp_mutated_blobs(which: int, muts: list[Mutation], rehash: bool) -> None:
    _count("mckp-mutated")
    blob = _mutate(BLOBS[which], muts)
    _read_all(_rehash(blob) if rehash else bytes(blob))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=8)
    | st.floats(allow_nan=True),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _rebuild(blob: bytes, edit: Callable[[dict[str, Any]], Any]) -> bytes:
    """Decode the header JSON of a valid blob, edit it, re-encode, shift the index offsets."""
    _magic, version, flags, hlen = PREAMBLE.unpack_from(blob)
    header = json.loads(zstandard.ZstdDecompressor().decompress(
        blob[PREAMBLE.size:PREAMBLE.size + hlen]))
    edit(header)
    new = zstandard.ZstdCompressor().compress(json.dumps(header).encode())
    shift = len(new) - hlen
    tb = blob[len(blob) - TRAILER_SIZE:len(blob) - TRAILER_SIZE + TRAILER.size]
    _h, ioff, ilen, icount, _hx, _ix, total, tver, magic, _tx = TRAILER.unpack(tb)
    index = bytearray(blob[ioff:ioff + ilen])
    for k in range(icount):
        t, c, off, ln = struct.unpack_from("<IIQQ", index, 24 * k)
        struct.pack_into("<IIQQ", index, 24 * k, t, c, off + shift, ln)
    data = blob[PREAMBLE.size + hlen:ioff]
    head = PREAMBLE.pack(b"MCKP", version, flags, len(new)) + new
    body = head + data + bytes(index)
    trailer = TRAILER.pack(len(new), ioff + shift, ilen, icount, 0, 0, total + shift, tver,
                           magic, 0)
    return _rehash(bytearray(body + trailer + HASH.pack(0)))


@FUZZ
@given(st.integers(0, len(BLOBS) - 1), st.data())
def test_mckp_edited_headers(which: int, data: st.DataObject) -> None:
    _count("mckp-header")
    blob = BLOBS[which]

    def edit(header: dict[str, Any]) -> None:
        for _ in range(data.draw(st.integers(1, 3))):
            paths = [p for p in _paths(header) if p]
            path = data.draw(st.sampled_from(paths))
            parent: Any = header
            for k in path[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(JSON_VALUES)

    _read_all(_rebuild(blob, edit))


def test_rebuild_of_an_unedited_header_is_valid() -> None:
    """The structural fuzzer really reaches the parser: an identity edit stays readable."""
    for blob in BLOBS[::2]:
        rebuilt = _rebuild(blob, lambda h: None)
        parse_blob(rebuilt, verify=True)
        decompress_state_dict(rebuilt, verify=True)


# ------------------------------------------------------------------------------- HPΔKV
def _hpdkv_blobs() -> list[bytes]:
    g = torch.Generator().manual_seed(1)
    r = torch.randn(6, 10, generator=g)
    return [pack_residuals(r.half()), pack_residuals(r.bfloat16(), store_topk=0.3),
            pack_residuals(r.half(), compress=True),
            pack_residuals(r.half(), store_topk=0.5, compress=True)]


HPDKV = _hpdkv_blobs()


def _unpack(blob: bytes) -> None:
    try:
        out = unpack_residuals(blob, max_elements=1 << 20)
    except MithrilError:
        return
    assert out.numel() <= 1 << 20


@FUZZ
@given(st.binary(max_size=512))
def test_hpdkv_random_bytes(data: bytes) -> None:
    _count("hpdkv-random")
    _unpack(data)
    _unpack(b"HPDV" + data)
    _unpack(b"HPDV\x01" + data)


@FUZZ
@given(st.integers(0, len(HPDKV) - 1), MUTATIONS)
def test_hpdkv_mutated_blobs(which: int, muts: list[Mutation]) -> None:
    _count("hpdkv-mutated")
    _unpack(bytes(_mutate(HPDKV[which], muts)))


@FUZZ
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=6),
       st.sampled_from([0, 1]), st.integers(0, 3), st.binary(max_size=64))
def test_hpdkv_declared_shapes(shape: list[int], dtype: int, flags: int, rest: bytes) -> None:
    """Huge declared shapes are refused before anything is allocated."""
    _count("hpdkv-shape")
    head = b"HPDV" + struct.pack("<BBBB", 1, dtype, len(shape), flags)
    head += struct.pack(f"<{len(shape)}I", *shape)
    head += b"\x00" * ((-len(head)) % 8)
    _unpack(head + rest)


def test_fuzz_counts_are_reported() -> None:
    print(f"fuzz examples per test: {EXAMPLES}; so far: {COUNTS}")
    assert np.iinfo(np.int64).max > 0
