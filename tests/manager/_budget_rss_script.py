"""Run by test_host_memory.py in a fresh process: build a state, save it under a budget and
print (as JSON) the save's peak extra RSS next to the pipeline's own account of it.

Usage: python _budget_rss_script.py RUNS_DIR STATE_MIB BUDGET_MIB blocking|overlapped

The baseline is the resident set once the state is built and the manager made; the peak
resident set (VmHWM) is then reset (``/proc/self/clear_refs``, Linux >= 4.0) so that what the
save adds is measured, not what building the state cost.
"""

from __future__ import annotations

import json
import sys

import torch

from mithril_async import CheckpointManager, TensorDict, parse_config


def status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) << 10 for line in f
                if line.startswith(("VmHWM", "VmRSS"))}


def main() -> None:
    runs, state_mib, budget_mib, mode = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                         sys.argv[4])
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    while total < state_mib << 20:  # 4 MiB tensors plus a small one per layer, fp32 and bf16
        dtype = torch.bfloat16 if i % 2 else torch.float32
        big = torch.rand(2 << 20 if i % 2 else 1 << 20, generator=g, dtype=dtype)
        tensors[f"layer{i}.weight"] = big
        tensors[f"layer{i}.norm"] = torch.ones(1024)
        total += big.numel() * big.element_size() + 4096
        i += 1
    live = TensorDict(tensors)
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "r"\n'
                       f"[checkpointing.pipeline]\nhost_memory_mib = {budget_mib}\n"
                       f'snapshot = "{mode}"\n')
    with CheckpointManager(cfg, {"model": live}) as m:
        base = status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        res = m.save_nowait(1).result()
        peak = status()["VmHWM"]
    print(json.dumps({"state": total, "rss_extra": peak - base, "host_peak": res.host_peak_bytes,
                      "streamed": res.streamed, "budget": budget_mib << 20,
                      "bytes_in": res.bytes_in}))


if __name__ == "__main__":
    main()
