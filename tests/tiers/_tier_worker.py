"""One rank of the node-loss tests (launched by ``launch()`` in test_node_loss.py).

By default four ranks are two "nodes" (``LOCAL_WORLD_SIZE=2``: ranks 0, 1 on node 0; 2, 3 on
node 1), each node with its own local folder (``<tmp>/node{node}``), one replica, and the
remote tier on a moto server the test started; ``lws``, ``replicas`` and ``timeout`` (the
tier layer's ``commit_timeout_s``) change that, and without ``bucket`` there is no remote
tier. Every rank's config is a TOML file with a ``[checkpointing.tiers]`` table (and
``[checkpointing.remote]`` with a bucket), and it writes what it saw to
``<out>/<what>_rank<r>.pt``:

- ``save``: as the README's quickstart, ``CheckpointManager.from_toml`` in ``async with``
  and ``await manager.save(step)``: three data-parallel steps, a save after each; the state
  saved at each step and the next random numbers (to check the RNG restore) are dumped, with
  the tiers each version reached. ``eio``: ``[rank, key suffix]``: on that rank every read of
  that file fails with EIO (a bad sector under one blob), so its replication must fail for
  that file alone.
- ``quickstart``: a fresh job as the README's quickstart: other initial weights,
  ``CheckpointManager.from_toml`` and ``await manager.restore("latest")``; dumps the
  restored state, the next random numbers and where each file came from.
- ``restore``: the same from a manager whose remote tier counts its GETs (``tier_remote``),
  ``manager.restore_sync()``; dumps also how many GETs reached the remote tier and the
  recovery's phases (a repair round shows as ``repair 1``). ``small``: the size up to which
  fetched copies are hashed on arrival (0: none, so a damaged peer copy is caught by the
  reader and repaired).
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mithril_async import CheckpointManager, load_config
from mithril_async.storage import open_store
from mithril_async.storage.base import Store
from tests.manager.conftest import TinyNet


class CountingStore:
    """Forwards to a store and counts the reads that reach it (GETs of any kind)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.gets = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def get(self, key: str) -> bytes:
        self.gets += 1
        return await self._inner.get(key)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        self.gets += 1
        return await self._inner.get_range(key, start, end)

    async def get_with_etag(self, key: str) -> Any:
        self.gets += 1
        return await self._inner.get_with_etag(key)


def _toml(a: dict[str, Any], rank: int) -> Path:
    """This rank's config file: the run, its tiers and (with a bucket) the remote tier."""
    text = (f'[checkpointing]\nruns_path = "runs"\nrun_id = "tiered"\nckpting_save_iter = 1\n'
            f'[checkpointing.pipeline]\nprocess = "worker"\n'  # saves in a checkpoint worker
            f"[checkpointing.compression]\nthreads = 1\n"
            f"enabled = {str(a['compress']).lower()}\n"
            f'[checkpointing.tiers]\nlocal = "{a["local"]}"\nreplicas = {a.get("replicas", 1)}\n'
            f"keep_local = 2\nkeep_replicated = 2\ncommit_timeout_s = {a.get('timeout', 60)}\n"
            f"upload = {str(a.get('bucket') is not None).lower()}\n")
    if a.get("bucket") is not None:
        text += (f'[checkpointing.remote]\nbucket = "{a["bucket"]}"\nprefix = "{a["prefix"]}"\n'
                 f'endpoint_url = "{a["endpoint"]}"\nmax_attempts = 2\n')
    path = Path(a["out"]) / f"train_rank{rank}.toml"
    path.write_text(text)
    return path


def _counted(a: dict[str, Any], rank: int, state: dict[str, Any]
             ) -> tuple[CheckpointManager, CountingStore | None]:
    """A manager on this rank's config whose remote tier counts the GETs reaching it."""
    remote = None
    if a.get("bucket") is not None:
        remote = CountingStore(open_store({"bucket": a["bucket"], "prefix": a["prefix"],
                                           "endpoint_url": a["endpoint"], "max_attempts": 2}))
    mgr = CheckpointManager(load_config(_toml(a, rank)), state, tier_remote=remote)
    assert mgr.process == "worker"  # the tiers are served there, not run inline instead
    return mgr, remote


class _UnreadableFile:
    """An ``os`` whose ``open`` of a path ending in ``suffix`` for reading fails with EIO."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if str(path).endswith(self.suffix) and not flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return os.open(path, flags, mode, **kw)


def _unreadable(suffix: str) -> None:
    """Every read of the file ending in ``suffix`` fails with EIO in this process, through
    the tier layer's own mapping and through the node store's reads."""
    from mithril_async.storage import local as local_mod
    from mithril_async.tiers import replicate

    fs = _UnreadableFile(suffix)
    local_mod.os = fs  # type: ignore[assignment]
    replicate.os = fs  # type: ignore[assignment]


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = TinyNet(d=8, vocab=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt}


def _step(state: dict[str, Any], rank: int, i: int) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(100 * rank + i))
    loss = model(x).float().pow(2).mean() + torch.randn(()) * 1e-3
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():  # data-parallel: the same weights on every rank
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "optimizer": [v.clone() for s in state["optimizer"].state.values()
                          for v in s.values() if isinstance(v, torch.Tensor)]}


def save(a: dict[str, Any], rank: int) -> dict[str, Any]:
    if a.get("eio") is not None and a["eio"][0] == rank:
        _unreadable(a["eio"][1])
    torch.manual_seed(1000 + rank)
    state = _state(7)
    seen: dict[str, Any] = {"snap": {}, "next_rand": {}}

    async def train() -> None:  # the README's quickstart
        async with CheckpointManager.from_toml(_toml(a, rank), state=state) as manager:
            for i in range(1, 4):
                _step(state, rank, i)
                await manager.save(i)
                seen["snap"][i] = _snapshot(state)
                rng = torch.get_rng_state()
                seen["next_rand"][i] = torch.rand(4)
                torch.set_rng_state(rng)
            await manager.wait_until_finished()
            assert manager.tiers is not None
            results = manager.tiers.wait()
            seen["reached"] = {r.version_id: sorted(r.reached) for r in results}
            seen["errors"] = {r.version_id: r.errors for r in results}

    asyncio.run(train())
    return seen


def quickstart(a: dict[str, Any], rank: int) -> dict[str, Any]:
    state = _state(99)  # other initial weights: the restore must overwrite them

    async def resume() -> dict[str, Any]:  # the README's quickstart
        async with CheckpointManager.from_toml(_toml(a, rank), state=state) as manager:
            step = await manager.restore("latest")
            assert manager.tiers is not None
            return {"step": int(step), "snap": _snapshot(state), "next_rand": torch.rand(4),
                    "sources": {k: str(v) for k, v in manager.tiers.last_sources.items()}}

    return asyncio.run(resume())


def restore(a: dict[str, Any], rank: int) -> dict[str, Any]:
    if a.get("small") is not None:  # copies this small or smaller are hashed on arrival
        from mithril_async.tiers import fetch

        fetch.SMALL = a["small"]
    state = _state(99)  # other initial weights: the restore must overwrite them
    mgr, remote = _counted(a, rank, state)
    step = mgr.restore_sync()
    assert mgr.tiers is not None
    seen = {"step": int(step), "snap": _snapshot(state), "next_rand": torch.rand(4),
            "sources": {k: str(v) for k, v in mgr.tiers.last_sources.items()},
            "remote_gets": None if remote is None else remote.gets,
            "phases": sorted(mgr.tiers.last_timings)}
    mgr.close()
    return seen


def run_rank(scenario: str, a: dict[str, Any], rank: int, world: int, port: int) -> None:
    os.environ.update(a["env"])
    os.environ["LOCAL_WORLD_SIZE"] = str(a.get("lws", 2))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        seen = {"save": save, "quickstart": quickstart, "restore": restore}[scenario](a, rank)
        out = Path(a["out"])
        torch.save(seen, out / f".{scenario}_rank{rank}.tmp")
        os.replace(out / f".{scenario}_rank{rank}.tmp", out / f"{scenario}_rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
