"""ExCP-style lossy deltas: chains decode, stay bounded, and never touch exact tensors."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mithril_async.errors import MissingPrevious
from mithril_async.lossy.excp import (
    LossyDeltaConfig,
    LossyDeltaDecoder,
    LossyDeltaEncoder,
    _log2,
    _unpack_mask,
    decode_chain,
)
from mithril_async.lossy.training import adam_state, load_adam_state


@functools.lru_cache(maxsize=4)
def _snapshots(n: int = 6):
    _, _, snaps, roles = _trajectory(n)
    return snaps, roles


def _trajectory(n: int = 6, steps_between: int = 5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snaps = []
    roles = {}
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        for _ in range(steps_between):
            x = torch.randn(16, 32, generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        state, roles = adam_state(model, opt)
        snaps.append(state)
    return model, opt, snaps, roles


def test_chain_roundtrip_within_closed_loop_error() -> None:
    snaps, roles = _snapshots(6)
    cfg = LossyDeltaConfig(density=0.2, bits=6, keyframe_every=4, min_numel=64)
    enc, dec = LossyDeltaEncoder(cfg), LossyDeltaDecoder()
    out: dict[str, torch.Tensor] = {}
    for i, s in enumerate(snaps):
        prev = out
        ck = enc.encode(s, roles)
        assert ck.keyframe == (i % 4 == 0)
        out = dec.decode(ck, roles)
        fields = ck.manifest_fields()
        assert fields["has_quantization"] is (not ck.keyframe)
        for name, t in s.items():
            assert out[name].dtype == t.dtype and out[name].shape == t.shape
            if ck.keyframe or name not in roles or t.numel() < 64:
                assert torch.equal(out[name], t), name
            else:
                assert name in fields["lossy"]["tensors"]
                rec = ck.records[name]
                assert rec.values is not None
                kept, blob = ck.masks[rec.mask_key]
                idx = _unpack_mask(kept, blob, t.numel())
                if rec.domain == "log2":  # exp_avg_sq: relative error of kept entries
                    lerr = (_log2(out[name]) - _log2(t)).reshape(-1).abs()
                    assert lerr[idx].max() <= rec.values.max_abs_error + 1e-3, name
                    continue
                err = (out[name] - t).reshape(-1).abs()
                # kept entries: within the quantiser's measured bound (plus fp32 add rounding)
                assert err[idx].max() <= rec.values.max_abs_error + 1e-6, name
                # the rest: off by at most the residual against the previous reconstruction
                ref = prev[name] if rec.ref == "prev" else torch.zeros_like(t)
                assert err.max() <= (t - ref).abs().max() + 1e-6, name
        if not ck.keyframe:
            assert ck.ratio > 3
    assert (out["optim/0.weight/exp_avg_sq"] >= 0).all()


def test_linear_moments_mode_and_joint_masks() -> None:
    snaps, roles = _snapshots(3)
    cfg = LossyDeltaConfig(density=0.1, min_numel=100, v_log=False, fisher_weighted=False)
    enc = LossyDeltaEncoder(cfg)
    chain = [enc.encode(s, roles) for s in snaps]
    last = chain[-1]
    assert set(last.masks) == {"0.weight/param", "2.weight/param"}  # one mask per group
    assert all(r.domain == "linear" for r in last.records.values())
    out = decode_chain(chain, roles)
    assert (out["optim/0.weight/exp_avg_sq"] >= 0).all()
    assert last.manifest_fields()["lossy"]["config"]["v_log"] is False


def test_exact_tensors_never_lossy() -> None:
    snaps, roles = _snapshots(4)
    cfg = LossyDeltaConfig(density=0.05, min_numel=1, exact=("model/2.*", "optim/0.weight/*"))
    enc = LossyDeltaEncoder(cfg)
    chain = [enc.encode(s, roles) for s in snaps]
    out = decode_chain(chain, roles)
    for name in ("model/2.weight", "model/2.bias", "optim/0.weight/exp_avg",
                 "optim/0.weight/exp_avg_sq", "optim/0.weight/step"):
        assert torch.equal(out[name], snaps[-1][name]), name
        assert all(c.records[name].kind == "lossless" for c in chain)
        assert name not in chain[-1].manifest_fields()["lossy"]["tensors"]
    assert not torch.equal(out["model/0.weight"], snaps[-1]["model/0.weight"])


def test_chain_needs_its_previous() -> None:
    snaps, roles = _snapshots(3)
    enc = LossyDeltaEncoder(LossyDeltaConfig(min_numel=1))
    chain = [enc.encode(s, roles) for s in snaps]
    with pytest.raises(MissingPrevious):
        LossyDeltaDecoder().decode(chain[1], roles)
    dec = LossyDeltaDecoder()
    dec.decode(chain[0], roles)
    with pytest.raises(MissingPrevious):
        dec.decode(chain[2], roles)
    with pytest.raises(MissingPrevious):
        decode_chain([], roles)


def test_resume_from_lossy_state_trains() -> None:
    model, opt, snaps, roles = _trajectory(4)
    enc = LossyDeltaEncoder(LossyDeltaConfig(density=0.1, min_numel=1))
    state = decode_chain([enc.encode(s, roles) for s in snaps], roles)
    load_adam_state(model, opt, state)
    x = torch.randn(16, 32)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
