"""Delta chains: bytes stored per version (full vs ours vs naive XOR) and restore cost.

On real trajectories from benchmarks/make_trajectory.py (pre-training-like lr 1e-3 and
fine-tuning-like lr 1e-5, fp32 and bf16, weights + AdamW moments of consecutive steps):

* full: every version a keyframe (delta off), mean bytes per version after the first;
* ours: ``delta = true, keyframe_interval = K`` through the CheckpointManager (XOR against the
  previous version in the grouped/exponent-plane domain, zstd/Huffman per plane, dedup);
* naive: XOR with the previous step + plain byte grouping + zstd-3 per tensor (the baseline
  the issue names), mean bytes per version after the first (no keyframes: unbounded chains);
* restore: median wall time of ``restore_sync`` of the last version of a chain (reads K blobs)
  divided by that of its keyframe (for ``delta_base = "keyframe"``: the worst of versions
  2..K);
* ours, ``delta_base = "keyframe"``: every delta XORed against the chain's keyframe (a restore
  reads 2 blobs; with its default ``delta_min_gain = 0.1`` a tensor whose delta saves less is
  stored in full, and a restore reads of the keyframe only the tensors the deltas need): its
  delta size vs naive and its restore ratio, side by side.

    python benchmarks/bench_delta.py [--steps 9] [--k 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_trajectory import load_step, make_trajectory

from mithril_async import CheckpointManager, TensorDict, parse_config
from mithril_async.codec import kernels, tensor_bytes

#: restores of the keyframe and the K-th version, alternating (each ~50-200 ms here, and the
#: shared machine swings tens of percent from one to the next)
RESTORE_ROUNDS = 9


def naive_bytes(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> int:
    z = zstandard.ZstdCompressor(level=3)
    total = 0
    for k, t in cur.items():
        a, b = tensor_bytes(t)[0], tensor_bytes(prev[k])[0]
        w = t.element_size()
        x = kernels.xor_group(a, b, w) if w > 1 else kernels.xor(a, b)
        total += len(z.compress(x.tobytes()))
    return total


def split(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    w = {k: v for k, v in sd.items() if k.startswith("model.")}
    o = {k: v for k, v in sd.items() if not k.startswith("model.")}
    return w, o


def run_manager(steps: list[dict[str, torch.Tensor]], root: Path, delta: bool, k: int,
                base: str = "previous") -> tuple[list[tuple[int, int]], float | None]:
    """Save every step; return [(model bytes, optimizer bytes)] and restore(last)/restore(kf)."""
    w0, o0 = split(steps[0])
    w, o = TensorDict({n: t.clone() for n, t in w0.items()}), TensorDict(
        {n: t.clone() for n, t in o0.items()})
    cfg = parse_config(f'[checkpointing]\nruns_path = "{root}/runs"\nrun_id = "d"\n'
                       f"[checkpointing.compression]\ndelta = {str(delta).lower()}\n"
                       f'keyframe_interval = {k}\ndelta_base = "{base}"\n')
    sizes = []
    with CheckpointManager(cfg, {"model": w, "optimizer": o}) as m:
        for i, sd in enumerate(steps, 1):
            ws, os_ = split(sd)
            for n, t in ws.items():
                w.tensors[n].copy_(t)
            for n, t in os_.items():
                o.tensors[n].copy_(t)
            res = m.save_nowait(i).result()
            assert res.status == "committed"
        for i in range(1, len(steps) + 1):
            man = json.loads((root / "runs" / "d" / "versions" / f"v{i:06d}" / "manifest.json")
                             .read_text())
            sizes.append((man["model"]["bytes"], man["optimizer"]["shards"][0]["bytes"]))
        ratio = None
        if delta:
            last = min(len(steps), k)
            # chained to the previous version the K-th is the worst by construction; against
            # the keyframe any delta may be, so every one is timed and the worst reported
            targets = [last] if base == "previous" else list(range(2, last + 1))
            times: dict[int, list[float]] = {v: [] for v in (1, *targets)}
            for _ in range(RESTORE_ROUNDS):  # alternating: the machine's drift hits all
                for v in times:
                    t0 = time.perf_counter()
                    m.restore_sync(v)
                    times[v].append(time.perf_counter() - t0)
            ratio = max(statistics.median(times[v]) for v in targets) / statistics.median(
                times[1])
    return sizes, ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = ["| trajectory | part | raw MB | full MB/v | naive MB/v | ours delta MB/v | "
            "ours/naive | ours chain MB/v | chain ratio vs raw | restore K-th / keyframe | "
            "kf-base delta MB/v | kf-base / naive | kf-base restore worst / keyframe |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        for label, lr in (("pretrain", 1e-3), ("finetune", 1e-5)):
            for dtype in ("float32", "bfloat16"):
                out = Path(tmp) / f"{label}-{dtype}"
                paths = make_trajectory(out, steps=args.steps, lr=lr, dtype=dtype, seed=0)
                steps = [load_step(p) for p in paths]
                full, _ = run_manager(steps, out / "full", False, args.k)
                ours, restore_ratio = run_manager(steps, out / "delta", True, args.k)
                kfb, kf_restore = run_manager(steps, out / "kfbase", True, args.k, "keyframe")
                for part, idx in (("weights", 0), ("adam", 1)):
                    raw = sum(t.numel() * t.element_size()
                              for t in split(steps[0])[idx].values())
                    naive = statistics.mean(
                        naive_bytes(split(steps[i - 1])[idx], split(steps[i])[idx])
                        for i in range(1, len(steps)))
                    f = statistics.mean(s[idx] for s in full[1:])
                    d = statistics.mean(s[idx] for s in ours[1:args.k])  # delta versions
                    chain = statistics.mean(s[idx] for s in ours[:args.k])  # keyframe + deltas
                    kd = statistics.mean(s[idx] for s in kfb[1:args.k])
                    rows.append(f"| {label} {dtype} | {part} | {raw / 1e6:.1f} | {f / 1e6:.2f} | "
                                f"{naive / 1e6:.2f} | {d / 1e6:.2f} | {d / naive:.2f} | "
                                f"{chain / 1e6:.2f} | {raw / chain:.1f}x | "
                                f"{restore_ratio:.2f} | {kd / 1e6:.2f} | {kd / naive:.2f} | "
                                f"{kf_restore:.2f} |")
    print(f"steps per trajectory: {args.steps}, keyframe_interval: {args.k}; full and naive: "
          "mean over versions 2..N; ours delta: mean over the K-1 delta versions of the first "
          "chain; ours chain: mean over keyframe + deltas (what a run stores); restore: the "
          f"K-th version (K blobs; kf-base: the worst of versions 2..K) vs the keyframe, whole "
          f"manager restore, median of "
          f"{RESTORE_ROUNDS} alternating rounds")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
