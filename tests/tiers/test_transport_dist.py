"""GlooLink in two real processes: bytes both ways at once; a hung peer is an error naming it,
raised by the deadline, and the group refuses further use instead of pairing wrong messages."""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from pathlib import Path

from tests.tiers._link_worker import run_rank

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.tiers._link_worker"])


def test_exchange_and_deadline(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [_CTX.Process(target=run_rank, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 90
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"link_rank{r}.json").read_text()) for r in range(2))
    assert r0["good"] == [(3 << 20) + 4, "02", "tail", 0]
    assert r1["good"] == [(3 << 20) + 4, "01", "tail", 0]
    assert r0["gathered"] == r1["gathered"] == [0, 10]
    err = r0["hang_error"]
    assert "rank 0/2: copies to rank 1 (tier replicated) (with rank(s) [1]) failed within 2s" in err
    assert r0["peer_still_hanging"]  # the deadline fired, not the peer leaving
    assert "unusable after an earlier failure" in r0["after_error"]
