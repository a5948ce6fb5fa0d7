"""The markdown section ``make gpu-check`` prints at the end (and writes as summary.md): the GPU
tables and the issue-23 targets, met or not, ready to paste into docs/BENCHMARKS.md.

Reads what the earlier stages wrote into the results folder: ``loop.json``
(bench_train_loop.py --json), ``codec.json`` (bench_codec.py --json) and ``tests.log`` (pytest
-v output); a missing piece is reported as missing, not guessed.

    python benchmarks/gpu_report.py --results DIR [--torch-source image|registry]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

PINNED = ("DCP async_save pinned", "DCP async_save pinned, async staging")
TORN_TEST = "test_hundred_overlapped_saves_none_torn"


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi: not available"
    return out.splitlines()[0] if out else "nvidia-smi: no GPU"


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _command(script: str, data: dict[str, Any] | None) -> str:
    if data is None:
        return f"`{script}`: not run"
    return f"`python benchmarks/{script} {' '.join(data.get('argv', []))}`"


def tests_section(log: Path) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ["CUDA tests: no tests.log (the stage did not run)", ""]
    counts = {}
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", tail):
        counts[what] = int(n)
    summary = ", ".join(f"{n} {w}" for w, n in counts.items()) or f"no summary line ({tail!r})"
    lines = [f"CUDA tests (`pytest -m cuda tests/gpu`): {summary}."]
    failed = re.findall(r"^(tests/gpu/\S+) (?:FAILED|ERROR)", text, flags=re.M)
    if failed:
        lines.append("Failed: " + ", ".join(f"`{t}`" for t in failed) + ".")
    return [*lines, ""]


def torn_status(log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "not run"
    m = re.search(rf"{TORN_TEST}\S* (PASSED|FAILED|ERROR|SKIPPED)", text)
    return m.group(1).lower() if m else "not run"


def loop_section(loop: dict[str, Any] | None, torn: str) -> list[str]:
    if loop is None:
        return ["Training loop: no loop.json (the stage failed or did not run; see loop.log).",
                ""]
    med = loop["median"]
    plain = loop["plain_step_s"]
    pinned = [n for n in PINNED if n in med]
    ref = min(pinned, key=lambda n: med[n]["blocked"]) if pinned else loop["reference"]
    out = [f"{loop['what']} {loop['dtype']}, {loop['params'] / 1e6:.0f} M params, state "
           f"(model + AdamW) {loop['state_bytes'] / 1e9:.2f} GB; ours "
           f"{'with' if loop['compression'] else 'without'} compression; median of "
           f"{loop['saves']} saves; training step without a save {plain * 1e3:.1f} ms. "
           f"Ratios against **{ref}** (the DCP with the shorter blocked time). Blocked = the "
           "call + what the host waited before `optimizer.step()`; on a GPU our overlapped "
           "step waits on the device instead (its kernels queue behind the copies), which shows "
           "in the step time, so *loop cost* = call + step with the save in flight - plain "
           "step counts every kind of wait (median per save).", "",
           "| system | call ms | step wait ms | blocked ms | blocked / DCP | step ms (save in "
           "flight) | step / plain step | loop cost ms | loop cost / DCP | e2e s | e2e / DCP |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cost = {name: statistics.median(r["call"] + r["step"] - plain for r in rows)
            for name, rows in loop["rows"].items()}
    rb, re2e, rc = med[ref]["blocked"], med[ref]["e2e"], cost[ref]
    for name in loop["order"]:
        m = med[name]
        out.append(f"| {name} | {m['call'] * 1e3:.2f} | {m['wait'] * 1e3:.2f} | "
                   f"{m['blocked'] * 1e3:.2f} | {m['blocked'] / rb:.3f} | {m['step'] * 1e3:.1f} "
                   f"| {m['step'] / plain:.2f} | {cost[name] * 1e3:.1f} | "
                   f"{cost[name] / rc if rc > 0 else float('nan'):.2f} | "
                   f"{m['e2e']:.3f} | {m['e2e'] / re2e:.2f} |")
    out.append("")
    pinned = loop.get("pinned_host") or {}
    if pinned.get("allocated_bytes.current"):
        ours = sum(n in med for n in ("mithril overlapped", "mithril blocking"))
        out += [f"Pinned host memory held by torch's caching allocator (our staging buffers, "
                f"{ours} managers): {pinned['allocated_bytes.current'] / 1e9:.2f} GB in "
                f"{pinned['allocations.current']} blocks for {ours} x "
                f"{loop['state_bytes'] / 1e9:.2f} GB of state (blocks are rounded up to a "
                "power of two).", ""]
    out.append("Targets (issue 23):")
    dcp_slow = min(med[n]["step"] for n in pinned) / plain if pinned else None
    for mode in ("mithril overlapped", "mithril blocking"):
        if mode not in med:
            out.append(f"- {mode}: not measured")
            continue
        r = med[mode]["blocked"] / rb
        out.append(f"- {mode}: blocked {r:.3f}x DCP (target <= 0.3x): {_verdict(r <= 0.3)}; "
                   f"loop cost {cost[mode] * 1e3:.1f} ms vs DCP's {rc * 1e3:.1f} ms")
    if "mithril overlapped" in med:
        ms = med["mithril overlapped"]["blocked"] * 1e3
        out.append(f"- overlapped blocked {ms:.2f} ms per save (target <= 1 ms): "
                   f"{_verdict(ms <= 1.0)}")
    if dcp_slow is not None:
        for mode in ("mithril overlapped", "mithril blocking"):
            if mode in med:
                s = med[mode]["step"] / plain
                out.append(f"- {mode}: step while a save is in flight {s:.2f}x a plain step, "
                           f"DCP pinned {dcp_slow:.2f}x (target <= DCP's): "
                           f"{_verdict(s <= dcp_slow)}")
    out.append(f"- no torn version in 100 overlapped saves (`{TORN_TEST}`): {torn}"
               + (" → **met**" if torn == "passed" else ""))
    return [*out, ""]


def codec_section(codec: dict[str, Any] | None) -> list[str]:
    if codec is None:
        return ["Codec: no codec.json (the stage failed or did not run; see codec.log).", ""]
    t = codec["targets_gibs"]
    out = [f"{codec['cpu']}, {codec['cpus']} CPUs; kernels {codec['kernels']}; bf16 TinyLM "
           f"{codec['params'] / 1e6:.0f} M params, weights + AdamW moments, "
           f"{codec['raw_bytes'] / 2**30:.2f} GiB raw; median of {codec['runs']} runs.", "",
           "| threads | ratio | compress GiB/s | decompress GiB/s |", "|---:|---:|---:|---:|"]
    for r in codec["results"]:
        out.append(f"| {r['threads']} | {r['raw_bytes'] / r['blob_bytes']:.4f} | "
                   f"{r['compress_gibs']:.2f} | {r['decompress_gibs']:.2f} |")
    at = [r for r in codec["results"] if r["threads"] == t["cores"]] or codec["results"][-1:]
    r = at[0]
    out += ["", f"Seed targets on {t['cores']} cores (measured at {r['threads']} threads): "
            f"compress {r['compress_gibs']:.2f} GiB/s vs {t['compress']} "
            f"{_verdict(r['compress_gibs'] >= t['compress'])}; decompress "
            f"{r['decompress_gibs']:.2f} GiB/s vs {t['decompress']} "
            f"{_verdict(r['decompress_gibs'] >= t['decompress'])}.", ""]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--torch-source", default="unknown")
    a = ap.parse_args()
    loop = _load(a.results / "loop.json")
    codec = _load(a.results / "codec.json")
    torch_line = (f"torch {loop['torch']}" if loop else "torch: see setup.log")
    lines = ["## GPU", "Command: `make gpu-check` (benchmarks/gpu_check.sh; docs/GPU.md)  ",
             f"Date: {datetime.date.today().isoformat()}; device: {_driver()}; {torch_line} "
             f"(from the {a.torch_source})", ""]
    lines += tests_section(a.results / "tests.log")
    lines += ["### Training loop on the GPU", _command("bench_train_loop.py", loop), ""]
    lines += loop_section(loop, torn_status(a.results / "tests.log"))
    lines += ["### Codec threads", _command("bench_codec.py", codec), ""]
    lines += codec_section(codec)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
