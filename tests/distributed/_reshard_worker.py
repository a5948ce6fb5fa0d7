"""One rank of the resharding tests (test_reshard_dist.py): save DTensor state at one world
size and mesh, restore it at another, and load the same state with torch.distributed.checkpoint
(the oracle) at the new world size, dumping what each rank got to ``<out>/<name>_rank<r>.pt``.

The state: three parameters placed differently (``Shard(0)`` of 7 rows, ``Shard(1)`` of 5
columns: uneven on 2, 3 and 4 ranks; ``Replicate``), on a 1-D mesh, or on a 2-D (2, 2) mesh at
4 ranks; AdamW moments follow their parameters, step counters are replicated; a per-rank data
position goes through the default ``on_reshard``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # preloaded by the forkserver, as in _worker.py
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mithril_async import CheckpointManager, parse_config
from mithril_async.sharded import ShardedModel, ShardedOptimizer
from tests.manager.conftest import Batcher

SHAPES = {"w0": (7, 6), "w1": (4, 5), "b": (3,)}


def placements(world: int, two_d: bool) -> tuple[Any, dict[str, list[Any]]]:
    if two_d:
        mesh = init_device_mesh("cpu", (2, world // 2))
        return mesh, {"w0": [Shard(0), Shard(1)], "w1": [Replicate(), Shard(1)],
                      "b": [Shard(0), Replicate()]}
    mesh = init_device_mesh("cpu", (world,))
    return mesh, {"w0": [Shard(0)], "w1": [Shard(1)], "b": [Replicate()]}


class Net(torch.nn.Module):
    def __init__(self, seed: int, world: int, two_d: bool) -> None:
        super().__init__()
        mesh, place = placements(world, two_d)
        g = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            full = torch.randn(shape, generator=g)
            self.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(full, mesh, place[name])))


def train(net: Net, opt: torch.optim.Optimizer, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)  # the same global gradient on every rank
        for p in net.parameters():
            assert isinstance(p, DTensor)
            p.grad = distribute_tensor(torch.randn(tuple(p.shape), generator=g),
                                       p.device_mesh, p.placements)
        opt.step()


def config(runs: Path, compress: bool) -> Any:
    return parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "rs"\n'
                        f"[checkpointing.compression]\nenabled = {str(compress).lower()}\n"
                        "threads = 1\nchunk_mib = 0.0001\n")


def manager(runs: Path, net: Net, opt: torch.optim.Optimizer, batcher: Batcher,
            compress: bool = True) -> CheckpointManager:
    state = {"model": ShardedModel(net), "optimizer": ShardedOptimizer(net, opt),
             "batcher": batcher}
    return CheckpointManager(config(runs, compress), state, sharded_model=True)


def dtensor_state(net: Net, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The state as DTensors (what DCP saves and loads), keyed by parameter name."""
    params = dict(net.named_parameters())
    return {"model": dict(params),
            "optim": {n: dict(opt.state[p]) for n, p in params.items() if p in opt.state}}


def local(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's local shards, flat: ``w0``, ``w0.exp_avg``, ``w0.step``, ..."""
    out: dict[str, torch.Tensor] = {}
    for n, p in net.named_parameters():
        out[n] = p.to_local().clone()
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
    return out


def full(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The global tensors (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for n, p in net.named_parameters():
        out[n] = p.full_tensor()
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def oracle(dcp_dir: Path, net: Net) -> dict[str, torch.Tensor]:
    """The state loaded by DCP into zeros laid out like ``net`` (this world and mesh)."""
    sd: dict[str, Any] = {"model": {}, "optim": {}}
    for n, p in net.named_parameters():
        assert isinstance(p, DTensor)

        def zeros(p: DTensor = p) -> DTensor:
            return distribute_tensor(torch.zeros(tuple(p.shape)), p.device_mesh, p.placements)

        sd["model"][n] = zeros()
        sd["optim"][n] = {"step": torch.zeros(()), "exp_avg": zeros(), "exp_avg_sq": zeros()}
    dcp.load(sd, checkpoint_id=str(dcp_dir))
    out: dict[str, torch.Tensor] = {}
    for n in SHAPES:
        out[n] = sd["model"][n].to_local()
        for k, v in sd["optim"][n].items():
            out[f"{n}.{k}"] = v.to_local() if isinstance(v, DTensor) else v
    return out


# ------------------------------------------------------------------ FSDP2 (fully_shard on CPU)
def fsdp_model(seed: int, world: int) -> torch.nn.Module:
    """Two linear layers (5 and 3 rows: uneven on 2, 3 and 4 ranks), each fully_shard-ed."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
               first: int) -> list[float]:
    """Data-parallel steps on the same batch everywhere; the global losses."""
    losses = []
    for s in range(first, first + steps):
        x = torch.randn(8, 7, generator=torch.Generator().manual_seed(s))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def canonical(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def fsdp_save(runs: Path, dcp_dir: Path, out: Path, rank: int, world: int) -> None:
    model = fsdp_model(1, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_steps(model, opt, 2, first=0)
    state = {"model": ShardedModel(model), "optimizer": ShardedOptimizer(model, opt)}
    m = CheckpointManager(config(runs, True), state, sharded_model=True)
    m.save_nowait(2).result()
    m.close()
    dcp.save(canonical(model, opt), checkpoint_id=str(dcp_dir))
    dump(out, "saved", rank, local=local(model, opt))


def fsdp_restore(runs: Path, dcp_dir: Path, out: Path, rank: int, world: int) -> None:
    """Ours and DCP's restores at this world size: the same local shards, and the training
    that continues from each gives the same losses."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = fsdp_model(2, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": ShardedModel(model), "optimizer": ShardedOptimizer(model, opt)}
    m = CheckpointManager(config(runs, True), state, sharded_model=True)
    res = m.restore_sync("latest")
    m.close()
    ref = fsdp_model(3, world)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sd = canonical(ref, ref_opt)
    dcp.load(sd, checkpoint_id=str(dcp_dir))
    set_model_state_dict(ref, sd["model"])
    set_optimizer_state_dict(ref, ref_opt, sd["optim"])
    seen = {"step": int(res), "exact": res.resume.exact, "local": local(model, opt),
            "oracle": local(ref, ref_opt)}
    seen["losses"] = fsdp_steps(model, opt, 3, first=2)
    seen["oracle_losses"] = fsdp_steps(ref, ref_opt, 3, first=2)
    dump(out, "restored", rank, **seen)


def dump(out: Path, name: str, rank: int, **data: Any) -> None:
    tmp = out / f".{name}_rank{rank}.tmp"
    torch.save(data, tmp)
    os.replace(tmp, out / f"{name}_rank{rank}.pt")


def save(runs: Path, dcp_dir: Path, out: Path, rank: int, world: int, two_d: bool,
         compress: bool) -> None:
    net = Net(seed=1, world=world, two_d=two_d)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, opt, 2)
    batcher = Batcher()
    batcher.position = 10 + rank
    m = manager(runs, net, opt, batcher, compress)
    torch.manual_seed(50 + rank)  # per-rank RNG streams, captured by the save
    m.save_nowait(5).result()
    rand = torch.rand(4)  # what this rank draws next: a restore of its RNG draws the same
    m.close()
    dcp.save(dtensor_state(net, opt), checkpoint_id=str(dcp_dir))
    dump(out, "saved", rank, full=full(net, opt), local=local(net, opt), rand=rand)


def restore(runs: Path, dcp_dir: Path, out: Path, rank: int, world: int, two_d: bool,
            bad: bool) -> None:
    net = Net(seed=2, world=world, two_d=two_d)  # other weights, no optimizer state yet
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    batcher = Batcher()
    m = manager(runs, net, opt, batcher)
    res = m.restore_sync("latest")
    seen: dict[str, Any] = {"step": int(res), "exact": res.resume.exact,
                            "resharded": res.resume.resharded, "notes": res.resume.notes,
                            "position": batcher.get_state(), "local": local(net, opt),
                            "oracle": oracle(dcp_dir, net), "full": full(net, opt),
                            "rand": torch.rand(4)}
    m.close()
    if bad:
        seen.update(bad_input(runs, out, rank, world, two_d))
    dump(out, "restored", rank, **seen)


def bad_input(runs: Path, out: Path, rank: int, world: int, two_d: bool) -> dict[str, Any]:
    """A live shape that differs from the saved one, and a missing rank's blob: both raise
    before anything is written (the live state stays as it was)."""
    seen: dict[str, Any] = {}
    global SHAPES
    saved_shapes = SHAPES
    SHAPES = {**saved_shapes, "w1": (4, 6)}
    try:
        net = Net(seed=3, world=world, two_d=two_d)
    finally:
        SHAPES = saved_shapes
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    before = local(net, opt)
    m = manager(runs, net, opt, Batcher())
    try:
        m.restore_sync("latest")
        seen["shape_error"] = ""
    except Exception as err:
        seen["shape_error"] = f"{type(err).__name__}: {err}"
    seen["shape_untouched"] = _same(before, local(net, opt))
    m.close()
    bad_runs = runs.parent / "bad" / runs.name  # keys name the runs folder: same name
    if rank == 0:
        shutil.copytree(runs, bad_runs)
        vdir = bad_runs / "rs" / "versions" / "v000001"
        gone = sorted(vdir.glob("model_shard_rank0002.*"))
        assert gone, sorted(p.name for p in vdir.iterdir())
        gone[0].unlink()
    dist.barrier()
    net = Net(seed=4, world=world, two_d=two_d)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    before = local(net, opt)
    m = manager(bad_runs, net, opt, Batcher())
    try:
        m.restore_sync("latest")
        seen["missing_error"] = ""
    except Exception as err:
        seen["missing_error"] = f"{type(err).__name__}: {err}"
    seen["missing_untouched"] = _same(before, local(net, opt))
    m.close()
    return seen


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def run_rank(scenario: str, args: dict[str, Any], rank: int, world: int, port: int) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    runs, dcp_dir, out = Path(args["runs"]), Path(args["dcp"]), Path(args["out"])
    two_d = bool(args.get("two_d", False))
    if scenario == "fsdp_save":
        fsdp_save(runs, dcp_dir, out, rank, world)
    elif scenario == "fsdp_restore":
        fsdp_restore(runs, dcp_dir, out, rank, world)
    elif scenario == "save":
        save(runs, dcp_dir, out, rank, world, two_d, bool(args.get("compress", True)))
    else:
        restore(runs, dcp_dir, out, rank, world, two_d, bool(args.get("bad", False)))
    dist.barrier()
    dist.destroy_process_group()
