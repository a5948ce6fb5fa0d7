"""The lossless blob codec and the lossy tier read their own blobs: an MLDC blob is checked
by :func:`read_lossy_blob`, and the lossless :class:`FreshDecoder` refuses it instead of
knowing its format."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from mithril_async.errors import ChecksumMismatch, InvalidFormat
from mithril_async.lossy.excp import LossyCheckpoint, LossyDeltaConfig, LossyDeltaEncoder
from mithril_async.lossy.serial import checkpoint_to_bytes
from mithril_async.lossy.training import adam_state
from mithril_async.manifest import ShardRef
from mithril_async.pipeline.lossy import read_lossy_blob
from mithril_async.restore.fresh import FreshDecoder
from mithril_async.storage.memory import MemoryStore

KEY = "run/versions/v000001/lossy_rank0000.mldc"


def _mldc() -> bytes:
    """One keyframe of a tiny model after one AdamW step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    state, roles = adam_state(model, opt)
    return checkpoint_to_bytes(LossyDeltaEncoder(LossyDeltaConfig(min_numel=64))
                               .encode(state, roles))


def _stored(data: bytes) -> tuple[MemoryStore, ShardRef]:
    store = MemoryStore()
    asyncio.run(store.put(KEY, data))
    return store, ShardRef(key=KEY, bytes=len(data), xxh64=xxhash.xxh64_hexdigest(data),
                           format="mldc", rank=0)


def _read(store: MemoryStore, ref: ShardRef) -> LossyCheckpoint:
    async def go() -> LossyCheckpoint:
        with ThreadPoolExecutor(1) as pool:
            return await read_lossy_blob(store, ref, ref.bytes, pool)

    return asyncio.run(go())


def test_read_lossy_blob_checks_and_parses() -> None:
    data = _mldc()
    assert _read(*_stored(data)).keyframe
    store, ref = _stored(data)
    with pytest.raises(ChecksumMismatch):  # the manifest's xxh64 no longer matches
        _read(store, ref.model_copy(update={"xxh64": "0" * 16}))
    with pytest.raises(InvalidFormat, match="manifest says"):
        _read(store, ref.model_copy(update={"bytes": ref.bytes + 1}))
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x40  # damage inside, hashed again as a careless copy would be
    with pytest.raises(InvalidFormat, match=f"{KEY}: checksum mismatch"):  # MLDC's own xxh64
        _read(*_stored(bytes(bad)))
    with pytest.raises(InvalidFormat, match=KEY):  # parse errors name the blob
        _read(*_stored(b"MLDC" + bytes([9]) + data[5:]))


def test_the_lossless_decoder_refuses_a_lossy_blob() -> None:
    store, ref = _stored(_mldc())

    async def go() -> object:
        with ThreadPoolExecutor(1) as pool:
            return await FreshDecoder(pool).read(store, ref)

    with pytest.raises(InvalidFormat, match="mldc"):
        asyncio.run(go())
