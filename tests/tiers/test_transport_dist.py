"""GlooLink in two real processes: bytes both ways at once; a hung peer is an error naming it,
raised by the deadline, and the group refuses further use instead of pairing wrong messages."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from tests.ranks import launch_ranks
from tests.tiers._link_worker import run_rank

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.tiers._link_worker"])


def test_exchange_and_deadline(tmp_path: Path) -> None:
    codes = launch_ranks(_CTX, run_rank, 2, lambda r, port: (r, port, str(tmp_path)), 90)
    assert codes == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"link_rank{r}.json").read_text()) for r in range(2))
    assert r0["good"] == [(3 << 20) + 4, "02", "tail", 0]
    assert r1["good"] == [(3 << 20) + 4, "01", "tail", 0]
    assert r0["gathered"] == r1["gathered"] == [0, 10]
    err = r0["hang_error"]
    assert "rank 0/2: copies to rank 1 (tier replicated) (with rank(s) [1]) failed within 2s" in err
    assert r0["peer_still_hanging"]  # the deadline fired, not the peer leaving
    assert "unusable after an earlier failure" in r0["after_error"]
