"""Throughput of the byte-transform kernels against a plain memcpy of the same bytes.

Why: grouping / XOR run on every byte of every checkpoint, so the issue's target is that native
group/ungroup reach at least 50% of memcpy bandwidth.  memcpy is ``np.copyto`` into a
preallocated buffer; every kernel also writes into a preallocated ``out=``.  Each row is the
median of ``--repeat`` runs on ``--mib`` MiB of random bytes (first call untimed, as warm-up).

    python benchmarks/bench_kernels.py [--mib 64] [--repeat 5] [--backend avx2|sse2|scalar|numpy]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from mithril_async.codec import kernels


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page-faults the output, loads caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(mib: int, repeat: int) -> list[tuple[str, float, float]]:
    """Return ``(name, MB/s, ratio to memcpy)`` rows for the current backend."""
    nbytes = mib << 20
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    b = rng.integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty(nbytes, dtype=np.uint8)

    cases: list[tuple[str, Callable[[], object]]] = [
        ("memcpy (np.copyto)", partial(np.copyto, out, a))
    ]
    for w in (2, 4, 8):
        cases.append((f"group w={w}", partial(kernels.group, a, w, out=out)))
        cases.append((f"ungroup w={w}", partial(kernels.ungroup, a, w, out=out)))
    cases.append(("xor", partial(kernels.xor, a, b, out=out)))
    for w in (2, 4, 8):
        cases.append((f"xor_group w={w}", partial(kernels.xor_group, a, b, w, out=out)))
        cases.append((f"ungroup_xor w={w}", partial(kernels.ungroup_xor, a, b, w, out=out)))
    for kind in ("bf16", "fp32"):
        cases.append((f"exp_group {kind}", partial(kernels.exp_group, a, kind, out=out)))
        cases.append((f"exp_ungroup {kind}", partial(kernels.exp_ungroup, a, kind, out=out)))
        cases.append((f"exp_group {kind} +base", partial(kernels.exp_group, a, kind, b, out)))
        cases.append((f"exp_ungroup {kind} +base", partial(kernels.exp_ungroup, a, kind, b, out)))

    rows: list[tuple[str, float, float]] = []
    memcpy_mbs = 0.0
    for name, fn in cases:
        mbs = nbytes / 1e6 / _median_seconds(fn, repeat)
        if not rows:
            memcpy_mbs = mbs
        rows.append((name, mbs, mbs / memcpy_mbs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default 64)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per kernel (median)")
    parser.add_argument("--backend", default=None, help="force numpy/scalar/sse2/avx2")
    args = parser.parse_args()
    if args.backend:
        kernels.set_backend(args.backend)
    print(f"backend: {kernels.BACKEND}   buffer: {args.mib} MiB   median of {args.repeat}")
    print(f"{'kernel':<26}{'MB/s':>10}{'vs memcpy':>12}")
    for name, mbs, ratio in run(args.mib, args.repeat):
        print(f"{name:<26}{mbs:>10.0f}{ratio:>11.0%}")


if __name__ == "__main__":
    main()
