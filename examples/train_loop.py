"""Demo: a TOML-configured training loop with background checkpointing, then a resume.

A small transformer language model trains on synthetic token data on the CPU. Every
``ckpting_save_iter`` steps ``manager.save_nowait(step)`` snapshots model + AdamW state (the only
time the loop waits) while the background pipeline compresses and commits it. Afterwards a fresh
manager restores ``latest`` into a fresh model and the demo checks the weights are identical.

    python examples/train_loop.py [--config configs/train.toml] [--steps 60] [--runs DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from mithril_async import CheckpointManager, SaveResult, load_config

ROOT = Path(__file__).resolve().parents[1]


class TinyLM(torch.nn.Module):
    """A two-layer transformer LM: big enough to be real, small enough for a laptop CPU."""

    def __init__(self, vocab: int, d_model: int, n_layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                                 dropout=0.1, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, n_layers)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


class TokenStream:
    """Synthetic next-token data whose position is resumable (get_state / set_state)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.position = vocab, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        base = torch.randint(0, self.vocab, (16, 1), generator=g)
        return (base + torch.arange(33)) % self.vocab  # learnable: next = current + 1

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def build(cfg_extra: dict[str, dict[str, int]], seed: int
          ) -> tuple[TinyLM, torch.optim.Optimizer, TokenStream]:
    m = cfg_extra.get("model", {})
    vocab = int(m.get("vocab", 512))
    torch.manual_seed(seed)
    model = TinyLM(vocab, int(m.get("d_model", 128)), int(m.get("n_layers", 2)))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), TokenStream(vocab)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "train.toml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", default=None, help="runs folder (default: a temp dir)")
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    runs = Path(args.runs) if args.runs else Path(tempfile.mkdtemp(prefix="mithril-demo-"))
    cfg.checkpointing.runs_path = str(runs / "runs")
    model, opt, data = build(cfg.extra, seed=0)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.2f} M params; runs in {runs / 'runs'}")
    print(f"{'step':>6} {'loss':>8} {'stall ms':>9} {'total s':>8} {'MB in':>8} {'MB out':>8} "
          f"{'ratio':>6}")
    rows: list[SaveResult] = []

    def report(res: SaveResult) -> None:
        rows.append(res)
        print(f"{res.step:>6} {losses[res.step]:>8.4f} "
              f"{(res.stall_s + res.step_wait_s) * 1e3:>9.1f} "
              f"{res.total_s:>8.3f} {res.bytes_in / 1e6:>8.2f} {res.bytes_out / 1e6:>8.2f} "
              f"{res.ratio:>6.2f}", flush=True)

    losses: dict[int, float] = {}
    state = {"model": model, "optimizer": opt, "data": data}
    t0 = time.perf_counter()
    with CheckpointManager(cfg, state, on_save=report) as manager:
        for step in range(1, args.steps + 1):
            x = data.next()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[step] = loss.item()
            if sys.stdout.isatty():  # a live progress bar; the save table prints below it
                done = int(30 * step / args.steps)
                print(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} "
                      f"loss {losses[step]:.4f}", end="\r" if step < args.steps else "\n",
                      flush=True)
            if manager.should_save(step):
                manager.save_nowait(step, metrics={"val_loss": losses[step]})
        manager.wait()
        run_id = manager.run_id
        kept = manager.all_steps()
        where = ("in a checkpoint worker process" if manager.process == "worker"
                 else "on threads of the training process")
    train_s = time.perf_counter() - t0
    print(f"trained {args.steps} steps in {train_s:.1f} s; kept versions at steps {kept}")
    print(f"saves ran {where}")
    if rows:
        stall = sum(r.stall_s + r.step_wait_s for r in rows) / len(rows)
        print(f"mean stall {stall * 1e3:.1f} ms per save; mean ratio "
              f"{sum(r.ratio for r in rows) / len(rows):.2f}x")

    # resume: a fresh process would do exactly this
    cfg.checkpointing.run_id = run_id
    fresh_model, fresh_opt, fresh_data = build(cfg.extra, seed=1)
    with CheckpointManager(cfg, {"model": fresh_model, "optimizer": fresh_opt,
                                 "data": fresh_data}) as resumed:
        step = resumed.restore_sync("latest")
        best = resumed.best_step()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh_model.state_dict().values(), strict=True))
    print(f"resumed from latest = step {step} (best = step {best}); data position "
          f"{fresh_data.position}; weights identical to the live model: {same}")
    return 0 if same and step == kept[-1] else 1


if __name__ == "__main__":
    raise SystemExit(main())
