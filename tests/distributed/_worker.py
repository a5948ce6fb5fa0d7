"""One rank of a multi-process test (launched by ``launch()`` in test_dist.py, like torchrun).

Launches are expensive on a loaded machine (each rank imports torch), so one launch checks
several things; every rank writes what it saw to ``<out>/<what>_rank<r>.pt``:

- ``crash``: (with ``faults``: first a run where rank 1's store fails during a save;) DDP
  training for ``total`` steps with one save at ``total // 2``; the final state is dumped as the
  reference, then every rank is SIGKILLed (the progress after the save is lost) — with
  ``faults``, rank 0 last, after it tried one more save with its peers already dead.
- ``resume``: restore ``latest`` of that run, train to ``total``, dump the final state; with
  ``other``, then restore a run saved with another world size (refused; model only works).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # preloaded by the forkserver: a lazy import in a forked rank raced
import torch.distributed as dist
from torch.utils._pytree import tree_map

from mithril_async import CheckpointManager, parse_config
from mithril_async.distributed import DistCoordinator
from mithril_async.errors import DistributedError, SaveFailed, StorageError
from mithril_async.sharded import ShardedModel, ShardedOptimizer, to_local
from mithril_async.storage.local import LocalStore
from tests.manager.conftest import Batcher, TinyNet


class FlakyStore(LocalStore):
    """A LocalStore whose ``put`` fails while ``fail`` is set (only this rank's files)."""

    fail = False

    async def put(self, key: str, data: bytes | memoryview) -> None:
        if self.fail and "rank" in key:
            raise StorageError(f"injected failure writing {key}")
        await super().put(key, data)


_WHERE: dict[str, int] = {}


def setup() -> tuple[int, int]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_WHERE['port']}",
                            rank=_WHERE["rank"], world_size=_WHERE["world"],
                            timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def config(runs: Path, run_id: str | None, every: int) -> Any:
    rid = f'run_id = "{run_id}"\n' if run_id else ""
    return parse_config(f'[checkpointing]\nruns_path = "{runs}"\n{rid}'
                        f"ckpting_save_iter = {every}\n[checkpointing.compression]\nthreads = 1\n")


def make(rank: int) -> tuple[TinyNet, torch.optim.Optimizer, Batcher]:
    torch.manual_seed(7)  # the same initial weights on every rank, as DDP would broadcast
    model = TinyNet(d=16, vocab=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batcher = Batcher(vocab=32)
    batcher.position = 1000 * rank  # each rank reads its own data
    torch.manual_seed(123 + rank)  # per-rank noise: a wrong RNG restore changes the result
    return model, opt, batcher


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batcher: Batcher) -> None:
    """Data-parallel step; gradients are averaged in rank order, so it is bit-reproducible
    (DDP's bucketed all-reduce is not across a restart: it rebuilds buckets on its first step).
    """
    x = batcher.next()
    logits = model(x)
    noise = torch.randn(logits.shape) * 1e-3
    loss = torch.nn.functional.cross_entropy((logits + noise).reshape(-1, logits.shape[-1]),
                                             x.reshape(-1))
    opt.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    mean = torch.stack(every).sum(0) / len(every)
    torch.nn.utils.vector_to_parameters(mean, grads)
    opt.step()


def dump(out: Path, name: str, rank: int, **data: Any) -> None:
    tmp = out / f".{name}_rank{rank}.tmp"
    torch.save(data, tmp)
    os.replace(tmp, out / f"{name}_rank{rank}.pt")


def write_failure(runs: Path, rank: int) -> dict[str, Any]:
    """Rank 1's store fails during save 2; every rank must see the same error naming rank 1."""
    model, opt, batcher = make(rank)
    store = FlakyStore(runs.parent)
    state = {"model": model, "optimizer": opt, "batcher": batcher}
    # a generous bound for the saves that must succeed: a loaded machine may delay a rank
    manager = CheckpointManager(config(runs, "faults", 1), state, store=store,
                                runs_prefix=runs.name, coordinator=DistCoordinator(timeout_s=120))
    seen: dict[str, Any] = {}
    step(model, opt, batcher)
    manager.save_nowait(1).result()
    step(model, opt, batcher)
    store.fail = rank == 1
    try:
        manager.save_nowait(2).result()
    except DistributedError as err:
        seen["write_error"] = str(err)
    try:
        manager.wait()
    except SaveFailed as err:
        seen["wait_cause"] = type(err.__cause__).__name__
    store.fail = False
    dist.barrier()
    seen["versions_after_failure"] = sorted(os.listdir(runs / "faults" / "versions"))
    step(model, opt, batcher)
    batcher.exact = rank != 1  # rank 1's data position is best-effort: the version is not exact
    seen["after"] = manager.save_nowait(3).result().status
    seen["latest"] = manager.latest_step()
    manager.close()
    # rank 1 hangs (never joins save 4): rank 0 gives up after the timeout, publishes nothing.
    # Only this manager has a short timeout: the wait it bounds is meant to run out.
    hang = CheckpointManager(config(runs, "faults", 1), state, store=FlakyStore(runs.parent),
                             runs_prefix=runs.name, coordinator=DistCoordinator(timeout_s=5.0))
    dist.barrier()
    if rank == 0:
        try:
            hang.save_nowait(4).result()
        except DistributedError as err:
            seen["hang_error"] = str(err)
        seen["hang_latest"] = hang.latest_step()
    dist.barrier()
    hang.close(wait=False)
    return seen


def sharded(runs: Path, seed: int, extra: str = ""
            ) -> tuple[torch.nn.Module, torch.optim.Optimizer, CheckpointManager]:
    """A model whose weights are DTensors sharded by rows (as FSDP2 shards them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 6)
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": ShardedModel(model), "optimizer": ShardedOptimizer(model, opt)}
    cfg = config(runs, "sharded", 1) if not extra else parse_config(
        f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "sharded"\n{extra}')
    manager = CheckpointManager(cfg, state, sharded_model=True)
    return model, opt, manager


def overlapped_sharded(runs: Path) -> dict[str, Any]:
    """snapshot = "overlapped" on DTensor shards: each save is followed at once by a step that
    must wait for the background copy; v2 restored must equal the state v2 was saved from."""
    model, opt, manager = sharded(runs, seed=5,
                                  extra='[checkpointing.pipeline]\nsnapshot = "overlapped"\n')
    saved = []
    for v in (1, 2, 3):
        sharded_step(model, opt)
        saved.append(local_state(model, opt))
        handle = manager.save_nowait(v)
        sharded_step(model, opt)  # changes every shard: the step pre-hook waits for the copy
        handle.result()
    assert manager.saves.guard is not None
    seen = {"deferred": len(manager.saves.guard.pointers()), "saved_v2": saved[1],
            "step": manager.restore_sync("v000002"), "restored_v2": local_state(model, opt)}
    manager.close()
    return seen


def lossy_sharded(runs: Path) -> dict[str, Any]:
    """The lossy tier across ranks: each rank codes its own DTensor shards; v2 and v3 are
    lossy deltas on v1. Restores v2 into fresh weights and reports what it got."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, CheckpointManager]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 32)
        for name, p in list(model.named_parameters()):
            setattr(model, name,
                    torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = parse_config(
            f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "lossy"\nckpting_save_iter = 1\n'
            "[checkpointing.lossy]\nenabled = true\ndensity = 0.25\nbits = 4\n"
            "min_numel = 64\nkeyframe_every = 4\nerror_rel = 0.05\n")
        state = {"model": ShardedModel(model), "optimizer": ShardedOptimizer(model, opt)}
        return model, opt, CheckpointManager(cfg, state, sharded_model=True)

    model, opt, manager = build(seed=3)
    saved = []
    for v in (1, 2, 3):
        sharded_step(model, opt)
        manager.save_nowait(v).result()
        saved.append(local_state(model, opt))
    manager.close()
    fresh, fopt, manager = build(seed=4)
    seen: dict[str, Any] = {"saved_v2": saved[1], "step": manager.restore_sync("v000002"),
                            "restored_v2": local_state(fresh, fopt)}
    manager.close()
    vdir = runs / "lossy" / "versions" / "v000002"
    seen["manifest_v2"] = json.loads((vdir / "manifest.json").read_text())
    return seen


def sharded_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    def clone(t: Any) -> Any:
        return t.clone() if isinstance(t, torch.Tensor) else t

    return tree_map(clone, {"model": to_local(model.state_dict()),
                            "opt": to_local(opt.state_dict())})


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie is dead: its sockets are closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def dead_peer(manager: CheckpointManager, runs: Path, step_: int,
              peers: list[int]) -> dict[str, Any]:
    """Rank 0 saves after the other ranks were killed: it must fail fast (from their closed
    connections, not by waiting out the timeout) and publish nothing."""
    deadline = time.monotonic() + 120  # a safety net: SIGKILL takes effect at once
    while any(_alive(pid) for pid in peers):
        assert time.monotonic() < deadline, f"peer ranks {peers} were never killed"
        time.sleep(0.01)
    seen: dict[str, Any] = {}
    try:
        manager.save_nowait(step_).result()
        seen["dead_error"] = ""
    except DistributedError as err:
        seen["dead_error"] = str(err)
    seen["latest_after_dead"] = manager.latest_step()
    seen["manifests"] = sorted(str(p.relative_to(runs)) for p in runs.glob("*/versions/*/*.json")
                               if p.name == "manifest.json")
    return seen


def crash(runs: Path, total: int, out: Path, faults: bool) -> None:
    rank, world = setup()
    seen = write_failure(runs.parent / "faults_runs", rank) if faults else {}
    if faults:  # each rank saves its DTensor shards; the resume launch restores them
        smodel, sopt, smanager = sharded(runs.parent / "sharded_runs", seed=0)
        sharded_step(smodel, sopt)
        smanager.save_nowait(1).result()
        seen["sharded_saved"] = local_state(smodel, sopt)
        smanager.close()
        seen["lossy"] = lossy_sharded(runs.parent / "lossy_runs")
        seen["overlapped"] = overlapped_sharded(runs.parent / "overlapped_runs")
    model, opt, batcher = make(rank)
    state = {"model": model, "optimizer": opt, "batcher": batcher}
    # generous: the save must succeed on a loaded machine; the dead peer below is detected
    # from its closed connection, not by this timeout
    manager = CheckpointManager(config(runs, None, total), state,
                                coordinator=DistCoordinator(timeout_s=120))
    for s in range(1, total + 1):
        step(model, opt, batcher)
        if s == total // 2:
            manager.save_nowait(s).result()
    dump(out, "crash", rank, model=model.state_dict(), opt=opt.state_dict(),
         batcher=batcher.get_state(), run_id=manager.run_id, **seen)
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    if faults and rank == 0 and world > 1:  # the other ranks are killed first
        dump(out, "dead", rank, **dead_peer(manager, runs, total + 1, pids[1:]))
    os.kill(os.getpid(), signal.SIGKILL)


def resume(runs: Path, run_id: str, total: int, out: Path, other: dict[str, str] | None) -> None:
    rank, _ = setup()
    model, opt, batcher = make(rank)
    state = {"model": model, "optimizer": opt, "batcher": batcher}
    manager = CheckpointManager(config(runs, run_id, total), state)  # default coordinator
    start = manager.restore_sync("latest")
    for _ in range(start + 1, total + 1):
        step(model, opt, batcher)
    dump(out, "resume", rank, model=model.state_dict(), opt=opt.state_dict(),
         batcher=batcher.get_state(), start=start)
    manager.close()
    if other is not None:
        dump(out, "world", rank, **world_change(Path(other["runs"]), other["run_id"], rank))
        # fresh weights and an optimizer without state: everything must come from the shards
        smodel, sopt, smanager = sharded(runs.parent / "sharded_runs", seed=1)
        smanager.restore_sync("latest")
        dump(out, "sharded", rank, restored=local_state(smodel, sopt))
        smanager.close()
    dist.destroy_process_group()


def world_change(runs: Path, run_id: str, rank: int) -> dict[str, Any]:
    """Restore a run saved with another world size: refused, except the model alone."""
    model, opt, batcher = make(rank)
    manager = CheckpointManager(config(runs, run_id, 1),
                                {"model": model, "optimizer": opt, "batcher": batcher})
    try:
        manager.restore_sync("latest")
        refused = ""
    except DistributedError as err:
        refused = str(err)
    step_ = manager.restore_sync("latest", load="model")
    manager.close()
    return {"refused": refused, "step": step_, "model": model.state_dict()}


def run_rank(scenario: str, args: dict[str, Any], rank: int, world: int, port: int) -> None:
    """Entry point of one rank (a forkserver child: torch is imported once, in the server)."""
    faulthandler.enable()
    _WHERE.update(rank=rank, world=world, port=port)
    runs, out = Path(args["runs"]), Path(args["out"])
    if scenario == "crash":
        crash(runs, args["total"], out, args.get("faults", False))
    elif scenario == "resume":
        resume(runs, args["run_id"], args["total"], out, args.get("other"))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
