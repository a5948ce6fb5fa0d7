"""One rank of the transport test (launched by test_transport_dist.py): a good exchange in
both directions, then rank 1 hangs (never posts its side) and rank 0 must fail by the
deadline with an error naming rank 1, and fail fast afterwards."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch.distributed as dist

from mithril_async.errors import DistributedError
from mithril_async.tiers.transport import GlooLink


def run_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    seen: dict[str, object] = {}
    link = GlooLink(timeout_s=2.0)
    peer = 1 - rank
    mine = bytes([rank + 1]) * (3 << 20) + b"tail"
    got = link.exchange([(peer, 1, mine), (peer, 2, b"")], [(peer, 1), (peer, 2)], "good")
    seen["good"] = [len(got[1]), bytes(got[1][:1]).hex(), bytes(got[1][-4:]).decode(),
                    len(got[2])]
    seen["gathered"] = link.all_gather(rank * 10, "gather")
    released = Path(out, "rank0_saw_the_error")
    if rank == 0:
        try:
            link.exchange([(1, 3, b"x" * 1000)], [(1, 4)], "copies to rank 1 (tier replicated)")
        except DistributedError as err:
            seen["hang_error"] = str(err)
        seen["peer_still_hanging"] = not Path(out, "rank1_gave_up").exists()
        try:
            link.all_gather(0, "after")
        except DistributedError as err:
            seen["after_error"] = str(err)
        released.touch()
    else:  # alive but not taking part (a hung peer) until rank 0 got its error
        for _ in range(600):
            if released.exists():
                break
            time.sleep(0.1)
        else:
            Path(out, "rank1_gave_up").touch()
    Path(out, f"link_rank{rank}.json").write_text(json.dumps(seen))
