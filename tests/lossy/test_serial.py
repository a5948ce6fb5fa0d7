"""MLDC v1 container of lossy delta checkpoints: roundtrip and typed errors on bad bytes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mithril_async.errors import InvalidFormat, UnknownFormatVersion
from mithril_async.lossy.excp import LossyDeltaConfig, LossyDeltaDecoder, LossyDeltaEncoder
from mithril_async.lossy.serial import checkpoint_from_bytes, checkpoint_to_bytes

from .test_lossy_delta import _snapshots


def _chain():
    snaps, roles = _snapshots(3)
    enc = LossyDeltaEncoder(LossyDeltaConfig(density=0.1, min_numel=64, exact=("model/2.bias",)))
    return [enc.encode(s, roles) for s in snaps], roles


CHAIN, ROLES = _chain()
BLOBS = [checkpoint_to_bytes(c) for c in CHAIN]


def test_roundtrip_decodes_identically() -> None:
    direct, via_bytes = LossyDeltaDecoder(), LossyDeltaDecoder()
    for ckpt, blob in zip(CHAIN, BLOBS, strict=True):
        back = checkpoint_from_bytes(blob)
        assert back.keyframe == ckpt.keyframe and back.config == ckpt.config
        a, b = direct.decode(ckpt, ROLES), via_bytes.decode(back, ROLES)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert len(BLOBS[1]) * 3 < CHAIN[1].raw_bytes


def test_header_errors() -> None:
    blob = bytearray(BLOBS[1])
    with pytest.raises(UnknownFormatVersion):
        checkpoint_from_bytes(bytes(blob[:4]) + b"\x02" + bytes(blob[5:]))
    for bad in (b"", b"XXXX" + bytes(blob[4:]), bytes(blob[:5]) + b"\x80" + bytes(blob[6:]),
                bytes(blob[:40]), bytes(blob[:-1])):
        with pytest.raises(InvalidFormat):
            r = checkpoint_from_bytes(bad)
            LossyDeltaDecoder().decode(checkpoint_from_bytes(BLOBS[0]), ROLES)
            dec = LossyDeltaDecoder()
            dec.decode(checkpoint_from_bytes(BLOBS[0]), ROLES)
            dec.decode(r, ROLES)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 255)), min_size=1, max_size=3))
def test_mutations_raise_only_typed_errors(edits: list[tuple[int, int]]) -> None:
    bad = bytearray(BLOBS[1])
    for pos, val in edits:
        bad[pos % len(bad)] = val
    dec = LossyDeltaDecoder()
    dec.decode(CHAIN[0], ROLES)
    with contextlib.suppress(InvalidFormat):
        dec.decode(checkpoint_from_bytes(bytes(bad)), ROLES)
