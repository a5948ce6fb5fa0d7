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

On a GPU (``--device cuda``, what ``make gpu-check`` runs) the model, its AdamW state and the
batches live on the device, every training step ends with ``torch.cuda.synchronize()`` (so the
step time includes any device-side wait, e.g. the optimizer's kernels queued behind our
overlapped copies), and the default systems are ours (both modes), DCP ``async_save`` with its
pinned cached stager (``DefaultStager(StagingOptions(use_pinned_memory=True,
use_shared_memory=False, ...))``, kept across saves so its pinned buffers are reused) with
synchronous staging and with asynchronous staging (then the loop waits for
``staging_completion`` before ``optimizer.step()``, counted as its step wait), and a blocking
``torch.save``. ``--params 1e9`` sizes the TinyLM (d 2048, 20 layers: ~1.0 B parameters);
``--prune`` deletes each checkpoint once it is durable (ours: ``keep_last = 1``) so 6 GB states
do not fill the disk; ``--json`` writes every measurement for ``benchmarks/gpu_check.sh``.

    python benchmarks/bench_train_loop.py [--model tinylm|minilm] [--d 256 --layers 4]
                                          [--dtype float32|bfloat16] [--saves 7]
    python benchmarks/bench_train_loop.py --device cuda --params 1e9 --dtype bfloat16 \
        --batch 8 --ctx 512 --saves 5 --prune --json loop.json
"""

from __future__ import annotations

import argparse
import json
import shutil
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
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.minilm = args.model == "minilm"
        self.batch, self.ctx = args.batch, args.ctx
        if self.minilm:
            self.model: torch.nn.Module = load_minilm(dtype).to(self.device)
        else:
            with self.device:  # built on the device: no host copy of a 1 B model first
                self.model = TinyLM(d=args.d, layers=args.layers, heads=max(1, args.d // 64),
                                    ctx=args.ctx).to(dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.data = _markov_batches(512, args.batch, args.ctx, 0).to(self.device)
        self.i = 0

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        if self.minilm:
            x, y = masked_batch(self.batch, self.ctx, self.i)
            return x.to(self.device), y.to(self.device)
        seq = self.data[self.i % len(self.data)]
        return seq[:, :-1], seq[:, 1:]

    def step(self, before_opt_step: Callable[[], None] | None = None) -> float:
        """One training step; on a GPU it ends with a device synchronize, so its time is the
        step's time on the device, waits queued there included. ``before_opt_step`` runs just
        before ``optimizer.step()`` (where DCP's asynchronous staging must be complete)."""
        x, y = self._inputs()
        t0 = time.perf_counter()
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if before_opt_step is not None:
            before_opt_step()
        self.opt.step()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def nbytes(self) -> int:
        sd = {**self.model.state_dict(), **{f"o{i}.{k}": v
                                            for i, s in enumerate(self.opt.state.values())
                                            for k, v in s.items()}}
        return sum(t.numel() * t.element_size() for t in sd.values()
                   if isinstance(t, torch.Tensor))


System = Callable[[int], Row]


def ours(loop: Loop, root: Path, snapshot: str, compress: bool, nice: int,
         prune: bool = False, process: str = "inline") -> System:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "bench"\n'
                       + ("keep_last = 1\n" if prune else "")
                       + f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n"
                       f'[checkpointing.pipeline]\nsnapshot = "{snapshot}"\n'
                       f'background_nice = {nice}\nprocess = "{process}"\n')
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


def dcp_async(loop: Loop, root: Path, prune: bool = False) -> System:
    def one(i: int) -> Row:
        t0 = time.perf_counter()
        fut: Any = dcp.async_save({"model": loop.model.state_dict(),
                                   "optim": loop.opt.state_dict()},
                                  checkpoint_id=str(root / f"dcp{i}"), no_dist=True)
        call = time.perf_counter() - t0
        step = loop.step()
        fut.result()
        e2e = time.perf_counter() - t0
        if prune:
            shutil.rmtree(root / f"dcp{i}", ignore_errors=True)
        return {"call": call, "wait": 0.0, "step": step, "e2e": e2e}

    return one


def dcp_pinned(loop: Loop, root: Path, async_staging: bool, prune: bool = False) -> System:
    """DCP ``async_save`` with its pinned, cached stager (torch >= 2.9:
    ``torch.distributed.checkpoint.staging.DefaultStager`` / ``StagingOptions``). One stager
    serves every save, so its pinned host copies (cached per source storage) are reused, as
    ours are. Synchronous staging: the call returns once the state is in pinned memory (the
    copy on the current stream, then a device synchronize). Asynchronous staging: the copy runs
    on the stager's thread and stream; the loop must not change the state before
    ``staging_completion``, so it waits for it before ``optimizer.step()`` (the step wait)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                          use_async_staging=async_staging,
                                          use_non_blocking_copy=True))

    def one(i: int) -> Row:
        t0 = time.perf_counter()
        resp: Any = dcp.async_save({"model": loop.model.state_dict(),
                                    "optim": loop.opt.state_dict()},
                                   checkpoint_id=str(root / f"dcp{i}"), no_dist=True,
                                   async_stager=stager)
        call = time.perf_counter() - t0
        staged = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        waited = [0.0]

        def wait_staged() -> None:
            if staged is not None and not staged.done():
                w0 = time.perf_counter()
                staged.result()
                waited[0] = time.perf_counter() - w0

        step = loop.step(wait_staged)
        upload.result()
        e2e = time.perf_counter() - t0
        if prune:
            shutil.rmtree(root / f"dcp{i}", ignore_errors=True)
        return {"call": call, "wait": waited[0], "step": step, "e2e": e2e}

    return one


def torch_save(loop: Loop, root: Path, prune: bool = False) -> System:
    """Plain ``torch.save`` of both state dicts: the loop is blocked for the whole save."""
    root.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> Row:
        t0 = time.perf_counter()
        path = root / f"ckpt{i}.pt"
        torch.save({"model": loop.model.state_dict(), "optim": loop.opt.state_dict()}, path)
        call = time.perf_counter() - t0
        step = loop.step()
        if prune:
            path.unlink(missing_ok=True)
        return {"call": call, "wait": 0.0, "step": step, "e2e": call}

    return one


#: --systems keys -> the names printed (CPU default: the first three, as always)
NAMES = {"overlapped": "mithril overlapped", "blocking": "mithril blocking",
         "worker": "mithril overlapped, worker", "worker-blocking": "mithril blocking, worker",
         "dcp": "DCP async_save", "dcp-pinned": "DCP async_save pinned",
         "dcp-pinned-async": "DCP async_save pinned, async staging", "torch-save": "torch.save"}
DEFAULT_SYSTEMS = {"cpu": "overlapped,blocking,dcp",
                   "cuda": "overlapped,blocking,worker,worker-blocking,dcp-pinned,"
                           "dcp-pinned-async,torch-save"}
#: the DCP the ratios are taken against: the first of these that ran (on a GPU the pinned one)
REFERENCES = ("dcp-pinned", "dcp-pinned-async", "dcp")


def size_for(params: float) -> tuple[int, int]:
    """(d, layers) of a TinyLM with about ``params`` parameters (~12 d^2 per layer)."""
    d = 2048 if params >= 5e8 else 1024 if params >= 5e7 else 512 if params >= 5e6 else 256
    return d, max(1, round(params / (12 * d * d)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tinylm", "minilm"], default="tinylm")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model trains (cuda: what make gpu-check runs)")
    ap.add_argument("--params", type=float, default=None,
                    help="TinyLM size in parameters, e.g. 1e9 (sets --d/--layers unless given)")
    ap.add_argument("--d", type=int, default=None, help="TinyLM width (default 256)")
    ap.add_argument("--layers", type=int, default=None, help="TinyLM layers (default 4)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--saves", type=int, default=7)
    ap.add_argument("--raw", action="store_true", help="ours without compression")
    ap.add_argument("--nice", type=int, default=0, help="our background_nice")
    ap.add_argument("--systems", default=None,
                    help="comma list of " + ", ".join(NAMES) + "; default: "
                    + "; ".join(f"{k}: {v}" for k, v in DEFAULT_SYSTEMS.items()))
    ap.add_argument("--prune", action="store_true",
                    help="delete each checkpoint once durable (ours: keep_last = 1)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device (torch.cuda.is_available() is false)")
    if args.params is not None:
        d, layers = size_for(args.params)
        args.d = d if args.d is None else args.d
        args.layers = layers if args.layers is None else args.layers
    args.d = 256 if args.d is None else args.d
    args.layers = 4 if args.layers is None else args.layers
    keys = (args.systems or DEFAULT_SYSTEMS[args.device]).split(",")
    unknown = [k for k in keys if k not in NAMES]
    if unknown:
        ap.error(f"unknown --systems {unknown}; choose from {list(NAMES)}")
    if args.device != "cuda" and any(k.startswith("dcp-pinned") for k in keys):
        ap.error("dcp-pinned systems need --device cuda (pinned staging needs CUDA)")
    torch.set_num_threads(2)
    loop = Loop(args)
    for _ in range(3):
        loop.step()
    plain = statistics.median(loop.step() for _ in range(9))
    with tempfile.TemporaryDirectory(prefix="bench-loop-", dir=args.out_dir) as tmp:
        root = Path(tmp)
        makers: dict[str, Callable[[], System]] = {
            "overlapped": lambda: ours(loop, root / "o", "overlapped", not args.raw, args.nice,
                                       args.prune),
            "blocking": lambda: ours(loop, root / "b", "blocking", not args.raw, args.nice,
                                     args.prune),
            "worker": lambda: ours(loop, root / "w", "overlapped", not args.raw, args.nice,
                                   args.prune, "worker"),
            "worker-blocking": lambda: ours(loop, root / "wb", "blocking", not args.raw,
                                            args.nice, args.prune, "worker"),
            "dcp": lambda: dcp_async(loop, root / "d", args.prune),
            "dcp-pinned": lambda: dcp_pinned(loop, root / "dp", False, args.prune),
            "dcp-pinned-async": lambda: dcp_pinned(loop, root / "da", True, args.prune),
            "torch-save": lambda: torch_save(loop, root / "t", args.prune),
        }
        systems: dict[str, System] = {NAMES[k]: makers[k]() for k in keys}
        rows: dict[str, list[Row]] = {name: [] for name in systems}
        for one in systems.values():
            one(0)  # warm-up: buffers, threads, imports
        names = list(systems)
        n = len(names)
        for i in range(1, args.saves + 1):
            for name in names[i % n:] + names[:i % n]:  # rotate who goes first
                rows[name].append(systems[name](i))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] if key != "blocked" else r["call"] + r["wait"]
                                 for r in rows[name])

    ref = next(NAMES[k] for k in (*REFERENCES, *keys) if k in keys)
    nparams = sum(p.numel() for p in loop.model.parameters())
    what = "all-MiniLM-L6-v2" if loop.minilm else f"TinyLM d={args.d} layers={args.layers}"
    where = (f" on {torch.cuda.get_device_name()} (torch {torch.__version__})"
             if loop.cuda else "")
    print(f"\n{what} {args.dtype}{where}: {nparams / 1e6:.1f} M params, "
          f"state (model + AdamW) {loop.nbytes() / 1e6:.1f} MB; "
          f"{'no compression' if args.raw else 'zstd'}; background_nice {args.nice}; "
          f"median of {args.saves} saves; "
          f"training step without a save: {plain * 1e3:.1f} ms")
    ref_label = "DCP" if ref == "DCP async_save" else "ref"
    print(f"| system | call ms | step wait ms | blocked ms | blocked / {ref_label} | step ms "
          f"(save in flight) | step / plain step | e2e s | e2e / {ref_label} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    d_blocked, d_e2e = med(ref, "blocked"), med(ref, "e2e")
    for name in names:
        print(f"| {name} | {med(name, 'call') * 1e3:.2f} | {med(name, 'wait') * 1e3:.2f} | "
              f"{med(name, 'blocked') * 1e3:.2f} | {med(name, 'blocked') / d_blocked:.2f} | "
              f"{med(name, 'step') * 1e3:.1f} | {med(name, 'step') / plain:.2f} | "
              f"{med(name, 'e2e'):.3f} | "
              f"{med(name, 'e2e') / d_e2e:.2f} |")
    if ref_label == "ref":
        print(f"(ref = {ref})")
    pinned: dict[str, Any] = {}
    if loop.cuda and hasattr(torch.cuda, "host_memory_stats"):
        # torch's caching pinned-memory allocator (our staging buffers; DCP's stager pins
        # with cudaHostRegister instead): blocks are rounded up to a power of two
        st = torch.cuda.host_memory_stats()
        pinned = {k: st.get(k) for k in ("allocated_bytes.current", "active_bytes.current",
                                         "allocations.current", "host_alloc_time.total")}
        print(f"pinned host memory held by torch's caching allocator: "
              f"{(pinned['allocated_bytes.current'] or 0) / 1e9:.2f} GB in "
              f"{pinned['allocations.current']} blocks, for "
              f"{sum(k in ('overlapped', 'blocking') for k in keys)} x "
              f"{loop.nbytes() / 1e9:.2f} GB of our staged state")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "argv": sys.argv[1:], "what": what, "dtype": args.dtype, "device": args.device,
            "device_name": torch.cuda.get_device_name() if loop.cuda else "cpu",
            "torch": torch.__version__, "params": nparams, "state_bytes": loop.nbytes(),
            "compression": not args.raw, "saves": args.saves, "plain_step_s": plain,
            "reference": ref, "order": names, "rows": rows, "pinned_host": pinned,
            "median": {name: {k: med(name, k) for k in ("call", "wait", "blocked", "step",
                                                         "e2e")} for name in names},
        }, indent=1))


if __name__ == "__main__":
    main()
