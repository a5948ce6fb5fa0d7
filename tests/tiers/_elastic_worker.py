"""One rank of the elastic tier test (test_tiers_elastic.py): tiers composed with resharding.

The state is sharded (DTensors on a 1-D mesh through ``ShardedModel`` / ``ShardedOptimizer``):
``w0`` (8 rows) and ``w1`` (4 rows) are ``Shard(0)``, ``b`` is replicated, and AdamW's moments
follow their parameters. At 4 ranks each rank holds a quarter of the rows; at 2 ranks, a
half: the new rank 1 reads saved ranks 2 and 3 (and rank 0's blob, which supplies the item's
skeleton and the replicated ``b``), never saved rank 1's. Every rank writes what it saw to
``<out>/<scenario>_rank<r>.pt``:

- ``save``: three optimizer steps, a save after each; rank 0 dumps the global tensors of
  each (the full-state oracle) to ``<out>/full_<step>.pt``.
- ``restore``: fresh weights at this world size, the manager's ``restore_sync`` of ``target``
  through the tiers (``strict``: ``manager.tiers.recover`` first); dumps this rank's local
  shards, what the oracle says they must be (the saved global tensors laid out
  on this world's mesh), the resume report, where each file came from and the remote GETs.
  ``then_save``: one more step and a save at this world size, then a fresh state and a
  second restore (of ``latest``: that save) by a new manager, dumping both.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # preloaded by the forkserver, as in _reshard_worker.py
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mithril_async import CheckpointManager, parse_config
from mithril_async.sharded import ShardedModel, ShardedOptimizer
from mithril_async.storage import open_store
from mithril_async.tiers.layer import TierLayer
from tests.distributed._reshard_worker import full, local
from tests.tiers._state import tier_config
from tests.tiers._tier_worker import CountingStore

SHAPES = {"w0": (8, 3), "w1": (4, 2), "b": (3,)}
PLACE = {"w0": Shard(0), "w1": Shard(0), "b": Replicate()}


class Net(torch.nn.Module):
    def __init__(self, seed: int, world: int) -> None:
        super().__init__()
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(distribute_tensor(
                torch.randn(shape, generator=g), mesh, [PLACE[name]])))


def train(net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)  # the same global gradient everywhere
    for p in net.parameters():
        assert isinstance(p, DTensor)
        p.grad = distribute_tensor(torch.randn(tuple(p.shape), generator=g), p.device_mesh,
                                   p.placements)
    opt.step()


def oracle(net: Net, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What this rank must hold after restoring ``saved`` (global tensors): each laid out on
    this job's mesh like the live parameter it belongs to."""
    params = dict(net.named_parameters())
    out = {}
    for key, t in saved.items():
        p = params[key.split(".")[0]]
        assert isinstance(p, DTensor)
        out[key] = (distribute_tensor(t, p.device_mesh, p.placements).to_local()
                    if t.shape == p.shape else t.clone())
    return out


def _manager(a: dict[str, Any], net: Net, opt: torch.optim.Optimizer
             ) -> tuple[CheckpointManager, CountingStore | None]:
    """A manager of the sharded state through the tiers ``a`` describes; its remote tier
    counts the GETs reaching it."""
    cfg = parse_config('[checkpointing]\nruns_path = "runs"\nrun_id = "elastic"\n'
                       "ckpting_save_iter = 1\n[checkpointing.pipeline]\n"
                       'process = "worker"\n[checkpointing.compression]\nthreads = 1\n'
                       "chunk_mib = 0.0001\n")
    remote = None
    if a.get("bucket") is not None:
        remote = CountingStore(open_store({"bucket": a["bucket"], "prefix": a["prefix"],
                                           "endpoint_url": a["endpoint"], "max_attempts": 2}))
    table = {"local": a["local"], "replicas": a["replicas"], "keep_local": 2,
             "keep_replicated": 2, "commit_timeout_s": 60, "upload": remote is not None}
    state = {"model": ShardedModel(net), "optimizer": ShardedOptimizer(net, opt)}
    mgr = CheckpointManager(tier_config(table, cfg), state, tier_remote=remote,
                            sharded_model=True)
    assert mgr.process == "worker"  # the tiers are served there, not run inline instead
    return mgr, remote


def _tiers(mgr: CheckpointManager) -> TierLayer:
    assert mgr.tiers is not None
    return mgr.tiers


def _sources(mgr: CheckpointManager) -> dict[str, str]:
    return {k: str(v) for k, v in _tiers(mgr).last_sources.items()}


def save(a: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    net = Net(1, world)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mgr, _ = _manager(a, net, opt)
    for i in range(1, 4):
        train(net, opt, i)
        mgr.save_nowait(i).result()
        glob = full(net, opt)
        if rank == 0:
            torch.save(glob, Path(a["out"]) / f"full_{i}.pt")
    results = _tiers(mgr).wait()
    seen = {"reached": {r.version_id: sorted(r.reached) for r in results},
            "errors": {r.version_id: r.errors for r in results}}
    mgr.close()
    return seen


def restore(a: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    net = Net(2, world)  # other weights, no optimizer state: the restore must fill them
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mgr, remote = _manager(a, net, opt)
    target = a.get("target", "latest")
    if a.get("strict"):  # every file hashed and written into the node folder first
        target = _tiers(mgr).recover(target)
        sources, phases = _sources(mgr), sorted(_tiers(mgr).last_timings)
    res = mgr.restore_sync(target)
    if not a.get("strict"):
        sources, phases = _sources(mgr), sorted(_tiers(mgr).last_timings)
    saved = torch.load(Path(a["out"]) / f"full_{int(res)}.pt")
    seen: dict[str, Any] = {
        "step": int(res), "exact": res.resume.exact, "resharded": res.resume.resharded,
        "local": local(net, opt), "oracle": oracle(net, saved),
        "sources": sources, "phases": phases,
        "remote_gets": None if remote is None else remote.gets}
    if a.get("then_save"):  # the next save at this world size, then restore it again
        train(net, opt, 4)
        mgr.save_nowait(4).result()
        seen["after"] = {r.version_id: (sorted(r.reached), r.errors)
                         for r in _tiers(mgr).wait()}
        seen["saved4"] = local(net, opt)
        mgr.close()
        net2 = Net(3, world)
        opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-2)
        mgr, _ = _manager(a, net2, opt2)
        res2 = mgr.restore_sync()
        seen.update(step2=int(res2), exact2=res2.resume.exact, local2=local(net2, opt2),
                    sources2=_sources(mgr))
    mgr.close()
    return seen


def run_rank(scenario: str, a: dict[str, Any], rank: int, world: int, port: int) -> None:
    os.environ.update(a["env"])
    os.environ["LOCAL_WORLD_SIZE"] = str(a["lws"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        seen = {"save": save, "restore": restore}[scenario](a, rank, world)
        out = Path(a["out"])
        torch.save(seen, out / f".{scenario}_rank{rank}.tmp")
        os.replace(out / f".{scenario}_rank{rank}.tmp", out / f"{scenario}_rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
