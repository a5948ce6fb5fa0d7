"""Make a small, real training trajectory to benchmark checkpoint codecs on.

A ~3.4 M-parameter decoder-only transformer is trained with AdamW on CPU for a few dozen steps
on synthetic token data (a fixed random Markov chain, so the loss really falls).  After each
saved step the full checkpoint state -- weights plus AdamW ``exp_avg``/``exp_avg_sq``/``step``
-- is written as one flat safetensors file::

    <out_dir>/<dtype>/step_000003.safetensors   keys: model.<param>, optim.<param>.<state>

so delta, lossless and lossy benchmarks all see the same consecutive checkpoints.  ``dtype``
``"bfloat16"`` trains the model in bf16 (weights and optimizer state in bf16, as a pure-bf16
run would store them).  Runs in well under a minute on two cores.

    python benchmarks/make_trajectory.py [out_dir] --steps 20 --dtype float32

Python API: ``make_trajectory(out_dir, steps, lr, dtype, seed) -> list[Path]`` and
``load_step(path) -> dict[str, Tensor]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = ["TinyLM", "load_step", "make_trajectory"]

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "bench_out" / "trajectory"


class TinyLM(nn.Module):
    """A minimal pre-norm transformer LM (what a real checkpoint's tensors look like)."""

    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 4, heads: int = 4,
                 ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        mask = self.mask[:t, :t].to(h.dtype)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _markov_batches(vocab: int, batch: int, ctx: int, seed: int) -> torch.Tensor:
    """An endless-ish supply of token sequences from a sparse random Markov chain."""
    g = torch.Generator().manual_seed(seed + 1)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g)  # 4 likely successors per token
    seqs = torch.empty(256, batch, ctx + 1, dtype=torch.long)
    cur = torch.randint(0, vocab, (256, batch), generator=g)
    for i in range(ctx + 1):
        seqs[:, :, i] = cur
        choice = torch.randint(0, 4, cur.shape, generator=g)
        cur = nxt[cur, choice]
    return seqs


def _flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    t = v.detach().clone().contiguous()
                    out[f"optim.{names[id(p)]}.{k}"] = t.reshape(1) if t.dim() == 0 else t
    return out


def make_trajectory(out_dir: str | Path = DEFAULT_OUT, steps: int = 20, lr: float = 1e-3,
                    dtype: str = "float32", seed: int = 0, *, save_every: int = 1,
                    batch: int = 4, ctx: int = 32) -> list[Path]:
    """Train ``steps`` AdamW steps; save every ``save_every``-th step; return the file paths.

    Files go to ``out_dir/<dtype>/step_NNNNNN.safetensors`` (plus ``trajectory.json`` with
    the settings and losses).  Deterministic for a given seed and torch version.
    """
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    torch.manual_seed(seed)
    model = TinyLM(ctx=ctx).to(tdt)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = _markov_batches(512, batch, ctx, seed)
    out = Path(out_dir) / dtype
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    losses: list[float] = []
    for step in range(1, steps + 1):
        seq = data[(step - 1) % len(data)]
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 512),
                                           seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % save_every == 0:
            p = out / f"step_{step:06d}.safetensors"
            save_file(_flat_state(model, opt), str(p), metadata={"step": str(step)})
            paths.append(p)
    (out / "trajectory.json").write_text(json.dumps(
        {"steps": steps, "lr": lr, "dtype": dtype, "seed": seed, "save_every": save_every,
         "params": sum(p.numel() for p in model.parameters()), "losses": losses,
         "files": [p.name for p in paths]}, indent=1))
    return paths


def load_step(path: str | Path) -> dict[str, torch.Tensor]:
    """One saved step as a flat ``{name: tensor}`` dict."""
    return load_file(str(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default=str(DEFAULT_OUT))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=1)
    a = ap.parse_args(argv)
    for dt in (["float32", "bfloat16"] if a.dtype == "both" else [a.dtype]):
        t = time.perf_counter()
        paths = make_trajectory(a.out_dir, a.steps, a.lr, dt, a.seed, save_every=a.save_every)
        info = json.loads((paths[0].parent / "trajectory.json").read_text())
        print(f"{dt}: {len(paths)} checkpoints of {info['params']:,} params in "
              f"{paths[0].parent} ({time.perf_counter() - t:.1f} s); loss "
              f"{info['losses'][0]:.3f} -> {info['losses'][-1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
