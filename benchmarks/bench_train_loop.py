"""How long checkpointing blocks a real training loop: ours (blocking and overlapped snapshot)
vs ``torch.distributed.checkpoint.async_save``, side by side in one process.

A model trains with AdamW on CPU: a TinyLM (make_trajectory.py's pre-norm transformer), or with
``--model minilm`` the real all-MiniLM-L6-v2 weights (minilm_model.py) on a masked-token loss;
the state is the model plus the optimizer. Every round, each system saves once (the order
rotates per round), then the loop runs one training step (forward, backward,
``optimizer.step()``) while the save finishes in the background, then waits for that save to be
durable. Per save:

* call: how long the save call blocked (ours: ``save_nowait``; DCP: ``get_state_dict`` is not
  needed on one process, so ``async_save`` of ``model.state_dict()`` and ``opt.state_dict()``).
* step wait: how long the following ``optimizer.step()`` waited for an overlapped copy
  (``SaveResult.step_wait_s``; zero for the others).
* blocked = call + step wait: the time checkpointing took from the loop.
* step: the training step that ran while the save was in the background (contention shows
  here), and its ratio to the median step without any save in flight. ``--nice N`` runs our
  background threads ``N`` nice levels below the training thread (``background_nice``;
  default 0, as the library's).
* e2e: from the call until the checkpoint is durable.

Medians over ``--saves`` rounds after one warm-up save per system.

    python benchmarks/bench_train_loop.py [--model tinylm|minilm] [--d 256 --layers 4]
                                          [--dtype float32|bfloat16] [--saves 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_trajectory import TinyLM, _markov_batches
from minilm_model import load_minilm, masked_batch

from mithril_async import CheckpointManager, parse_config

Row = dict[str, float]  # call, wait, step, e2e (seconds)


class Loop:
    """A model, its AdamW and a batch source; ``step()`` is one real training step."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        dtype = getattr(torch, args.dtype)
        self.minilm = args.model == "minilm"
        self.batch, self.ctx = args.batch, args.ctx
        self.model: torch.nn.Module = (
            load_minilm(dtype) if self.minilm else
            TinyLM(d=args.d, layers=args.layers, heads=max(1, args.d // 64),
                   ctx=args.ctx).to(dtype))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.data = _markov_batches(512, args.batch, args.ctx, 0)
        self.i = 0

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        if self.minilm:
            return masked_batch(self.batch, self.ctx, self.i)
        seq = self.data[self.i % len(self.data)]
        return seq[:, :-1], seq[:, 1:]

    def step(self) -> float:
        x, y = self._inputs()
        t0 = time.perf_counter()
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0

    def nbytes(self) -> int:
        sd = {**self.model.state_dict(), **{f"o{i}.{k}": v
                                            for i, s in enumerate(self.opt.state.values())
                                            for k, v in s.items()}}
        return sum(t.numel() * t.element_size() for t in sd.values()
                   if isinstance(t, torch.Tensor))


System = Callable[[int], Row]


def ours(loop: Loop, root: Path, snapshot: str, compress: bool, nice: int) -> System:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "bench"\n'
                       f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n"
                       f'[checkpointing.pipeline]\nsnapshot = "{snapshot}"\n'
                       f"background_nice = {nice}\n")
    manager = CheckpointManager(cfg, {"model": loop.model, "optimizer": loop.opt})

    def one(i: int) -> Row:
        t0 = time.perf_counter()
        handle = manager.save_nowait(i)
        call = time.perf_counter() - t0
        step = loop.step()  # its optimizer.step() waits for an overlapped copy, if any is left
        res = handle.result()
        return {"call": call, "wait": res.step_wait_s, "step": step,
                "e2e": time.perf_counter() - t0}

    return one


def dcp_async(loop: Loop, root: Path) -> System:
    def one(i: int) -> Row:
        t0 = time.perf_counter()
        fut: Any = dcp.async_save({"model": loop.model.state_dict(),
                                   "optim": loop.opt.state_dict()},
                                  checkpoint_id=str(root / f"dcp{i}"), no_dist=True)
        call = time.perf_counter() - t0
        step = loop.step()
        fut.result()
        return {"call": call, "wait": 0.0, "step": step, "e2e": time.perf_counter() - t0}

    return one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tinylm", "minilm"], default="tinylm")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--saves", type=int, default=7)
    ap.add_argument("--raw", action="store_true", help="ours without compression")
    ap.add_argument("--nice", type=int, default=0, help="our background_nice")
    args = ap.parse_args()
    torch.set_num_threads(2)
    loop = Loop(args)
    for _ in range(3):
        loop.step()
    plain = statistics.median(loop.step() for _ in range(9))
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        root = Path(tmp)
        systems: dict[str, System] = {
            "mithril overlapped": ours(loop, root / "o", "overlapped", not args.raw, args.nice),
            "mithril blocking": ours(loop, root / "b", "blocking", not args.raw, args.nice),
            "DCP async_save": dcp_async(loop, root / "d"),
        }
        rows: dict[str, list[Row]] = {name: [] for name in systems}
        for one in systems.values():
            one(0)  # warm-up: buffers, threads, imports
        names = list(systems)
        for i in range(1, args.saves + 1):
            for name in names[i % 3:] + names[:i % 3]:  # rotate who goes first
                rows[name].append(systems[name](i))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] if key != "blocked" else r["call"] + r["wait"]
                                 for r in rows[name])

    nparams = sum(p.numel() for p in loop.model.parameters())
    what = "all-MiniLM-L6-v2" if loop.minilm else f"TinyLM d={args.d} layers={args.layers}"
    print(f"\n{what} {args.dtype}: {nparams / 1e6:.1f} M params, "
          f"state (model + AdamW) {loop.nbytes() / 1e6:.1f} MB; "
          f"{'no compression' if args.raw else 'zstd'}; background_nice {args.nice}; "
          f"median of {args.saves} saves; "
          f"training step without a save: {plain * 1e3:.1f} ms")
    print("| system | call ms | step wait ms | blocked ms | blocked / DCP | step ms "
          "(save in flight) | step / plain step | e2e s | e2e / DCP |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    d_blocked, d_e2e = med("DCP async_save", "blocked"), med("DCP async_save", "e2e")
    for name in names:
        print(f"| {name} | {med(name, 'call') * 1e3:.2f} | {med(name, 'wait') * 1e3:.2f} | "
              f"{med(name, 'blocked') * 1e3:.2f} | {med(name, 'blocked') / d_blocked:.2f} | "
              f"{med(name, 'step') * 1e3:.1f} | {med(name, 'step') / plain:.2f} | "
              f"{med(name, 'e2e'):.3f} | "
              f"{med(name, 'e2e') / d_e2e:.2f} |")


if __name__ == "__main__":
    main()
