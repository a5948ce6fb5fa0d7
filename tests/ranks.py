"""Real multi-rank launches for tests (gloo ranks as processes, launched like torchrun).

Reusable from any test folder::

    from tests.ranks import launch_ranks
    codes = launch_ranks(_CTX, run_rank, world, lambda rank, port: (scenario, args, rank,
                                                                     world, port))

Each file keeps its own forkserver context (``multiprocessing.get_context("forkserver")``
with its worker module preloaded: a spawn per rank costs seconds here, a fork of a server that
imported torch once does not)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the rendezvous port of a launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(ctx: ForkServerContext, target: Callable[..., Any], world: int,
                 rank_args: Callable[[int, int], tuple[Any, ...]], timeout: float,
                 name: str | None = None) -> list[int | None]:
    """Start ``world`` processes of ``target(*rank_args(rank, port))`` sharing one free
    rendezvous port, wait for all of them up to ``timeout`` seconds in all, kill whichever is
    still alive then (a hung rank fails its test instead of hanging the suite), and return the
    exit codes by rank."""
    port = free_port()
    procs = [ctx.Process(target=target, args=rank_args(rank, port),
                         name=f"{name}-rank{rank}" if name else None) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]
