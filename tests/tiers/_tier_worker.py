"""One rank of the node-loss tests (launched by ``launch()`` in test_node_loss.py).

By default four ranks are two "nodes" (``LOCAL_WORLD_SIZE=2``: ranks 0, 1 on node 0; 2, 3 on
node 1), each node with its own local folder (``<tmp>/node{node}``), one replica, and the
remote tier on a moto server the test started; ``lws``, ``replicas`` and ``timeout`` (the
tier layer's ``commit_timeout_s``) change that, and without ``bucket`` there is no remote
tier. Every rank writes what it saw to ``<out>/<what>_rank<r>.pt``:

- ``save``: three data-parallel steps, a save after each; the state saved at each step and
  the next random numbers (to check the RNG restore) are dumped, with the tiers each version
  reached. ``eio``: ``[rank, key suffix]``: on that rank every read of that file fails with
  EIO (a bad sector under one blob), so its replication must fail for that file alone.
- ``restore``: a fresh model (other initial weights), ``Tiers.restore`` of ``latest``; dumps
  the restored state, the next random numbers, where each file came from, how many GETs
  reached the remote tier and the recovery's phases (a repair round shows as ``repair 1``).
  ``small``: the size up to which fetched copies are hashed on arrival (0: none, so a
  damaged peer copy is caught by the reader and repaired).
"""

from __future__ import annotations

import datetime
import errno
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mithril_async import parse_config
from mithril_async.storage import open_store
from mithril_async.storage.base import Store
from mithril_async.tiers import Tiers
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


def _config(a: dict[str, Any]) -> Any:
    return parse_config(f'[checkpointing]\nruns_path = "runs"\nrun_id = "tiered"\n'
                        f"ckpting_save_iter = 1\n[checkpointing.compression]\nthreads = 1\n"
                        f"enabled = {str(a['compress']).lower()}\n")


def _tiers(a: dict[str, Any]) -> tuple[Tiers, CountingStore | None]:
    remote = None
    if a.get("bucket") is not None:
        remote = CountingStore(open_store({"bucket": a["bucket"], "prefix": a["prefix"],
                                           "endpoint_url": a["endpoint"], "max_attempts": 2}))
    table = {"local": a["local"], "replicas": a.get("replicas", 1), "keep_local": 2,
             "keep_replicated": 2, "commit_timeout_s": a.get("timeout", 60),
             "upload": remote is not None}
    return Tiers(_config(a), table, remote=remote), remote


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
    from mithril_async.tiers import tiered

    fs = _UnreadableFile(suffix)
    local_mod.os = fs  # type: ignore[assignment]
    tiered.os = fs  # type: ignore[assignment]


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
    tiers, _ = _tiers(a)
    mgr = tiers.manager(state)
    seen: dict[str, Any] = {"snap": {}, "next_rand": {}}
    for i in range(1, 4):
        _step(state, rank, i)
        mgr.save_nowait(i).result()
        seen["snap"][i] = _snapshot(state)
        rng = torch.get_rng_state()
        seen["next_rand"][i] = torch.rand(4)
        torch.set_rng_state(rng)
    results = tiers.wait()
    seen["reached"] = {r.version_id: sorted(r.reached) for r in results}
    seen["errors"] = {r.version_id: r.errors for r in results}
    mgr.close()
    tiers.close()
    return seen


def restore(a: dict[str, Any], rank: int) -> dict[str, Any]:
    if a.get("small") is not None:  # copies this small or smaller are hashed on arrival
        from mithril_async.tiers import tiered

        tiered._SMALL = a["small"]
    state = _state(99)  # other initial weights: the restore must overwrite them
    tiers, remote = _tiers(a)
    mgr = tiers.manager(state)
    step = tiers.restore(mgr)
    seen = {"step": int(step), "snap": _snapshot(state), "next_rand": torch.rand(4),
            "sources": dict(tiers.last_sources),
            "remote_gets": None if remote is None else remote.gets,
            "phases": sorted(tiers.last_timings)}
    mgr.close()
    tiers.close()
    return seen


def run_rank(scenario: str, a: dict[str, Any], rank: int, world: int, port: int) -> None:
    os.environ.update(a["env"])
    os.environ["LOCAL_WORLD_SIZE"] = str(a.get("lws", 2))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        seen = {"save": save, "restore": restore}[scenario](a, rank)
        out = Path(a["out"])
        torch.save(seen, out / f".{scenario}_rank{rank}.tmp")
        os.replace(out / f".{scenario}_rank{rank}.tmp", out / f"{scenario}_rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
