"""Lossy-delta benchmark: compression ratio vs loss gap of a run resumed from lossy checkpoints.

What it does (deterministic, CPU, about a minute):
1. Trains a small MLP with AdamW on synthetic teacher data for ``--steps`` steps, snapshotting
   weights + AdamW state every ``--every`` steps (the uninterrupted baseline).
2. For each lossy setting, feeds the snapshots through a :class:`LossyDeltaEncoder` (lossless
   keyframe every ``keyframe_every`` checkpoints), decodes the chain up to the resume point,
   loads it into a fresh model/optimizer, and trains to the same final step on the same batches.
3. Prints, per setting: ratio of the delta checkpoints alone, ratio over the whole chain with
   its keyframes, and the relative gap of the final held-out loss vs the baseline; for
   settings whose chain has a second keyframe, also the gap when resuming from that keyframe
   (``gap@kf``: with ``keyframe_mode="quantized"`` that keyframe is itself lossy).
4. Repeats the lossy-keyframe rows on a real small transformer trajectory (the ~3.4 M-parameter
   ``TinyLM`` of benchmarks/make_trajectory.py, AdamW on its Markov-chain tokens; in memory,
   nothing written), unless ``--no-transformer``.

Ratios are against the raw fp32 bytes of weights + exp_avg + exp_avg_sq (+ step counters).
Usage: ``python benchmarks/bench_lossy.py [--steps 600 --every 25 --resume-at 9]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mithril_async.lossy.excp import (
    LossyCheckpoint,
    LossyDeltaConfig,
    LossyDeltaEncoder,
    Role,
    decode_chain,
)
from mithril_async.lossy.lossless import lossless_backend, lossless_state_size
from mithril_async.lossy.serial import checkpoint_from_bytes, checkpoint_to_bytes
from mithril_async.lossy.training import adam_state, load_adam_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_trajectory import TinyLM, _markov_batches

D_IN, HIDDEN, D_OUT, BATCH = 128, 512, 16, 128


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, D_OUT))


def _teacher() -> nn.Module:
    gen = torch.Generator().manual_seed(1234)
    t = nn.Sequential(nn.Linear(D_IN, 64), nn.Tanh(), nn.Linear(64, D_OUT))
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return t


TEACHER = _teacher()


def batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a given step: the same on every run, so resumed runs see the same data."""
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, D_IN, generator=gen)
    with torch.no_grad():
        y = TEACHER(x).argmax(dim=1)
    return x, y


EVAL = batch(-1, 4096)


def eval_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(EVAL[0]), EVAL[1]))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int,
          every: int = 0, snaps: list[dict[str, torch.Tensor]] | None = None
          ) -> dict[str, tuple[str, Role]]:
    roles: dict[str, tuple[str, Role]] = {}
    for step in range(start, stop):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if snaps is not None and every and (step + 1) % every == 0:
            state, roles = adam_state(model, opt)
            snaps.append(state)
    return roles


@dataclass
class Result:
    label: str
    delta_ratio: float
    chain_ratio: float
    loss: float
    gap: float
    kf_gap: float | None = None


@dataclass
class Workload:
    """A training run to checkpoint: fresh model/optimizer, a step range trainer, an eval."""

    name: str
    fresh: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    train: Callable[..., dict[str, tuple[str, Role]]]
    eval: Callable[[nn.Module], float]


def _resume(work: Workload, chain: list[LossyCheckpoint], roles: dict[str, tuple[str, Role]],
            at: int, every: int, steps: int) -> float:
    start = max(i for i in range(at + 1) if chain[i].keyframe)
    state = decode_chain(chain[start : at + 1], roles)
    model, opt = work.fresh()
    work.train(model, opt, 0, 1)  # materialise AdamW state tensors, then overwrite them all
    load_adam_state(model, opt, state)
    work.train(model, opt, (at + 1) * every, steps)
    return work.eval(model)


def run_setting(label: str, cfg: LossyDeltaConfig, snaps: list[dict[str, torch.Tensor]],
                roles: dict[str, tuple[str, Role]], resume_at: int, every: int, steps: int,
                base_loss: float, work: Workload | None = None) -> Result:
    work = work or MLP
    enc = LossyDeltaEncoder(cfg)
    chain: list[LossyCheckpoint] = [enc.encode(s, roles) for s in snaps]
    sizes = [len(checkpoint_to_bytes(c)) for c in chain]  # real serialized bytes (MLDC v1)
    assert checkpoint_from_bytes(checkpoint_to_bytes(chain[-1])).index == chain[-1].index
    d_raw = sum(c.raw_bytes for c in chain if not c.keyframe)
    delta_ratio = d_raw / max(1, sum(s for c, s in zip(chain, sizes, strict=True)
                                     if not c.keyframe))
    chain_ratio = sum(c.raw_bytes for c in chain) / sum(sizes)
    loss = _resume(work, chain, roles, resume_at, every, steps)
    kf = next((i for i, c in enumerate(chain) if c.keyframe and i > 0 and i < len(chain) - 1),
              None)
    kf_gap = None
    if kf is not None:
        kf_gap = (_resume(work, chain, roles, kf, every, steps) - base_loss) / base_loss
    return Result(label, delta_ratio, chain_ratio, loss, (loss - base_loss) / base_loss, kf_gap)


MLP = Workload("mlp", lambda: (lambda m: (m, make_optimizer(m)))(make_model()), train,
               eval_loss)

# ---------------------------------------------------------------- small transformer
TLM_BATCHES = _markov_batches(512, 4, 32, 0)  # make_trajectory's data (seed 0, ctx 32)
TLM_EVAL = TLM_BATCHES[200:256].reshape(-1, 33)  # held out: training uses batches < 200


def tlm_fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM(ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def tlm_train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int,
              every: int = 0, snaps: list[dict[str, torch.Tensor]] | None = None
              ) -> dict[str, tuple[str, Role]]:
    """make_trajectory's loop (step s uses batch s % 200), snapshotting like :func:`train`."""
    roles: dict[str, tuple[str, Role]] = {}
    for step in range(start, stop):
        seq = TLM_BATCHES[step % 200]
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, 512),
                                           seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if snaps is not None and every and (step + 1) % every == 0:
            state, roles = adam_state(model, opt)
            snaps.append(state)
    return roles


def tlm_eval(model: nn.Module) -> float:
    with torch.no_grad():
        logits = model(TLM_EVAL[:, :-1])
        return float(nn.functional.cross_entropy(logits.reshape(-1, 512),
                                                 TLM_EVAL[:, 1:].reshape(-1)))


TLM = Workload("tinylm", tlm_fresh, tlm_train, tlm_eval)


SETTINGS: list[tuple[str, LossyDeltaConfig]] = [
    ("d=0.10 b=4", LossyDeltaConfig(density=0.10, bits=4)),
    ("d=0.05 b=4", LossyDeltaConfig(density=0.05, bits=4)),
    ("d=0.03 b=4", LossyDeltaConfig(density=0.03, bits=4)),
    ("d=0.01 b=4", LossyDeltaConfig(density=0.01, bits=4)),
    ("d=0.01 v=0.005 b=3", LossyDeltaConfig(density=0.01, v_density=0.005, bits=3)),
    ("d=0.05 b=4 nofisher", LossyDeltaConfig(density=0.05, bits=4, fisher_weighted=False)),
    ("d=0.05 b=4 nojoint", LossyDeltaConfig(density=0.05, bits=4, joint=False)),
    ("d=0.05 v=0.01 b=4", LossyDeltaConfig(density=0.05, v_density=0.01, bits=4)),
    ("d=0.03 v=0.01 b=3", LossyDeltaConfig(density=0.03, v_density=0.01, bits=3)),
    ("d=0.05 b=4 linear-v", LossyDeltaConfig(density=0.05, bits=4, v_log=False)),
    ("d=0.05 b=4 kf=once", LossyDeltaConfig(density=0.05, bits=4, keyframe_every=10**6)),
    ("d=0.03 v=0.01 kf=once", LossyDeltaConfig(density=0.03, v_density=0.01, bits=3,
                                               keyframe_every=10**6)),
]

#: quantised keyframes (weights 8 bits, moments / log2 v at 6 or 4 bits): the whole chain
KEYFRAME_SETTINGS: list[tuple[str, LossyDeltaConfig]] = [
    ("qkf8/6 d=0.05 b=4 kf=10", LossyDeltaConfig(density=0.05, bits=4,
                                                 keyframe_mode="quantized")),
    ("qkf8/4 d=.03 v=.01 b=3 kf=10", LossyDeltaConfig(
        density=0.03, v_density=0.01, bits=3, keyframe_mode="quantized",
        keyframe_moment_bits=4)),
    ("qkf8/6 d=.03 v=.01 b=3 kf=20", LossyDeltaConfig(
        density=0.03, v_density=0.01, bits=3, keyframe_mode="quantized", keyframe_every=20)),
    ("qkf8/4 d=.03 v=.01 b=3 kf=24", LossyDeltaConfig(
        density=0.03, v_density=0.01, bits=3, keyframe_mode="quantized",
        keyframe_moment_bits=4, keyframe_every=24)),
    ("qkf8/4 d=.10 v=.01 b=2 mb=3 kf=24", LossyDeltaConfig(
        density=0.10, v_density=0.01, bits=2, moment_bits=3, keyframe_mode="quantized",
        keyframe_moment_bits=4, keyframe_every=24)),
    ("qkf8/4 d=.06 v=.01 b=3 nofisher kf=24", LossyDeltaConfig(
        density=0.06, v_density=0.01, bits=3, fisher_weighted=False,
        keyframe_mode="quantized", keyframe_moment_bits=4, keyframe_every=24)),
    ("qkf8/6 d=.03 v=.01 b=3 kf=20 bound", LossyDeltaConfig(
        density=0.03, v_density=0.01, bits=3, keyframe_mode="quantized", keyframe_every=20,
        error_rel=0.01, v_error_rel=0.5)),
]


def _row(r: Result) -> str:
    kf = "    n/a" if r.kf_gap is None else f"{100 * r.kf_gap:+7.2f}"
    return (f"{r.label:34} {r.delta_ratio:8.1f} {r.chain_ratio:8.1f} {r.loss:8.4f} "
            f"{100 * r.gap:+7.2f} {kf}")


HEADER = f"{'setting':34} {'delta x':>8} {'chain x':>8} {'loss':>8} {'gap %':>7} {'gap@kf':>7}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--resume-at", type=int, default=9, help="checkpoint index to resume from")
    ap.add_argument("--keyframe-every", type=int, default=None,
                    help="override every setting's keyframe interval (default 10)")
    ap.add_argument("--quick", action="store_true", help="only the first three settings")
    ap.add_argument("--no-transformer", action="store_true",
                    help="skip the small-transformer (make_trajectory TinyLM) rows")
    ap.add_argument("--tlm-steps", type=int, default=600)
    ap.add_argument("--tlm-every", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model = make_model()
    opt = make_optimizer(model)
    snaps: list[dict[str, torch.Tensor]] = []
    roles = train(model, opt, 0, args.steps, args.every, snaps)
    base = eval_loss(model)
    raw = sum(t.numel() * t.element_size() for t in snaps[-1].values())
    lossless = raw / lossless_state_size(snaps[-1])
    xor_delta = raw / lossless_state_size(snaps[-1], previous=snaps[-2])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MLP {n_params} params, {len(snaps)} checkpoints every {args.every} steps, "
          f"resume from checkpoint {args.resume_at} (step {(args.resume_at + 1) * args.every}) "
          f"to step {args.steps}; baseline final loss {base:.4f}; lossless keyframe ratio "
          f"{lossless:.2f}x (lossless XOR delta {xor_delta:.2f}x) [{lossless_backend()}]; "
          f"baseline {time.perf_counter() - t0:.1f}s")
    print(HEADER)
    settings = SETTINGS[:3] if args.quick else SETTINGS + KEYFRAME_SETTINGS
    for label, cfg in settings:
        if args.keyframe_every is not None:
            cfg = LossyDeltaConfig(**{**cfg.__dict__, "keyframe_every": args.keyframe_every})
        print(_row(run_setting(label, cfg, snaps, roles, args.resume_at, args.every,
                               args.steps, base)), flush=True)
    if not args.no_transformer:
        _transformer(args)
    print(f"total {time.perf_counter() - t0:.1f}s")


def _transformer(args: argparse.Namespace) -> None:
    t = time.perf_counter()
    model, opt = tlm_fresh()
    snaps: list[dict[str, torch.Tensor]] = []
    roles = tlm_train(model, opt, 0, args.tlm_steps, args.tlm_every, snaps)
    base = tlm_eval(model)
    resume_at = min(len(snaps) - 2, 9)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TinyLM (make_trajectory) {n_params} params, {len(snaps)} checkpoints every "
          f"{args.tlm_every} steps, resume from checkpoint {resume_at} to step {args.tlm_steps}; "
          f"baseline held-out loss {base:.4f} ({time.perf_counter() - t:.1f}s)")
    print(HEADER)
    for label, cfg in KEYFRAME_SETTINGS[:1] if args.quick else KEYFRAME_SETTINGS:
        print(_row(run_setting(label, cfg, snaps, roles, resume_at, args.tlm_every,
                               args.tlm_steps, base, TLM)), flush=True)


if __name__ == "__main__":
    main()
