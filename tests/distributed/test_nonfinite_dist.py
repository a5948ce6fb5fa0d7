"""The non-finite guard across ranks (2 gloo ranks in real processes): a NaN in rank 1's
own state holds, or fails, the whole version on every rank."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from tests.distributed._nonfinite_worker import run_rank
from tests.ranks import launch_ranks

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.distributed._nonfinite_worker"])


def test_one_ranks_nan_holds_or_fails_the_whole_version(tmp_path: Path) -> None:
    args = {"runs": str(tmp_path / "runs"), "out": str(tmp_path)}
    codes = launch_ranks(_CTX, run_rank, 2, lambda rank, port: (args, rank, 2, port), 120,
                         name="nonfinite")
    assert codes == [0, 0]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, s in enumerate(seen):
        h = s["hold"]
        assert (h["status"], h["held"], h["latest"]) == ("committed", True, 1)
        assert h["nonfinite"] == {"buffers/b": [1, 0]}  # rank 1's, known on rank 0 too
        assert h["restored"] == 1 and h["latest_values"] == [rank + 1.0] * 2
        assert h["explicit"] == 2 and h["explicit_nans"] == (1 if rank == 1 else 0)
        f = s["fail"]
        assert f["error"][0] == "NonFiniteState" and f["error"][2] == {"buffers/b": [0, 1]}
        assert "item buffers, tensor b: 0 NaN, 1 Inf" in f["error"][1]
        assert f["cause"] == "NonFiniteState" and f["steps_after_failure"] == []
        assert f["after"] == ["committed", [2], 2]
    manifest = json.loads((tmp_path / "runs" / "hold" / "versions" / "v000002" /
                           "manifest.json").read_text())
    assert manifest["held"] is True and manifest["world_size"] == 2
    shards = {s["rank"]: s.get("nonfinite") for s in manifest["extra"]["buffers"]}
    assert shards == {0: None, 1: {"buffers/b": {"nan": 1, "inf": 0}}}
