"""Node loss with tiers, in real processes over gloo: 4 ranks as 2 nodes, remote on moto.

One save run (three versions; every rank's manager made by ``CheckpointManager.from_toml``
from a TOML with a ``[checkpointing.tiers]`` table, as the README's quickstart does), then
restarted jobs after: node 0's folder wiped (restored from node 1's replicas, no GET reaches
the remote); node 0's folder wiped again and the run's objects gone from the bucket (a fresh
job of the quickstart, ``await manager.restore("latest")``, recovers from node 1's
replicas); node 0 wiped again and one replica on node 1 corrupted (that blob alone comes from
the remote); both nodes wiped (everything from the remote). Each restore must give back, bit
for bit, the state and RNG of the last save.

Three ranks as three nodes with two replicas and no remote: one file that cannot be read
(EIO) fails that version's replication for that file alone, on both sides, and the next
version replicates; with node 0 lost and its first replica holder lacking a file, the
second holder sends it.
"""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import launch_ranks
from tests.s3_server import MotoS3
from tests.tiers._tier_worker import run_rank

WORLD = 4
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.tiers._tier_worker"])


def launch(scenario: str, args: dict[str, Any], timeout: float = 120, world: int = WORLD
           ) -> list[dict[str, Any]]:
    codes = launch_ranks(_CTX, run_rank, world,
                         lambda r, port: (scenario, args, r, world, port), timeout)
    assert codes == [0] * world, scenario
    out = Path(args["out"])
    got = [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(world)]
    for r in range(world):
        (out / f"{scenario}_rank{r}.pt").unlink()
    return got


def _move(moto: MotoS3, src: str, dst: str) -> int:
    """Every object under the prefix ``src`` moved to ``dst`` (server-side copies); how many."""
    keys = moto.objects(src)
    for key in keys:
        moto.client.copy_object(Bucket=moto.bucket, Key=dst + key[len(src):],
                                CopySource={"Bucket": moto.bucket, "Key": key})
        moto.client.delete_object(Bucket=moto.bucket, Key=key)
    return len(keys)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["model"].keys() == b["model"].keys()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and len(a["optimizer"]) == len(b["optimizer"])
            and all(torch.equal(x, y) for x, y in zip(a["optimizer"], b["optimizer"],
                                                       strict=True)))


@pytest.fixture(scope="module")
def moto() -> Any:
    with MotoS3() as s3:
        yield s3


@pytest.mark.parametrize("compress", [True])
def test_node_loss(tmp_path: Path, moto: MotoS3, compress: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prefix = moto.unique_prefix("tiers")
    args: dict[str, Any] = {"local": str(tmp_path / "node{node}"), "bucket": moto.bucket,
            "prefix": prefix, "endpoint": moto.endpoint_url,
            "env": moto.env, "out": str(out), "compress": compress}
    saved = launch("save", args)
    for r in range(WORLD):
        assert saved[r]["errors"] == {"v000001": {}, "v000002": {}, "v000003": {}}
        assert set(saved[r]["reached"]["v000003"]) == {"local", "replicated", "remote"}
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    versions = node1 / "runs" / "tiered" / "versions"
    # keep_local = 2 on the fast tiers; the remote keeps everything (no keep_* set)
    assert sorted(p.name for p in versions.iterdir()) == ["v000002", "v000003"]
    assert sorted(p.name for p in (node1 / "replica/runs/tiered/versions").iterdir()) == [
        "v000002", "v000003"]
    assert sum(k.endswith("manifest.json") for k in moto.objects(prefix)) == 3
    # node 1 holds replicas of ranks 0 and 1 (same local rank on the next node)
    held = sorted(p.name for p in (node1 / "replica/runs/tiered/versions/v000003").iterdir())
    assert "opt_shard_rank0000.bin" in held and "opt_shard_rank0001.bin" in held
    assert not any("rank0002" in n or "rank0003" in n for n in held)

    def check(got: list[dict[str, Any]]) -> None:
        for r in range(WORLD):
            assert got[r]["step"] == 3
            assert _same(got[r]["snap"], saved[r]["snap"][3]), f"rank {r} state differs"
            assert torch.equal(got[r]["next_rand"], saved[r]["next_rand"][3]), f"rank {r} RNG"

    # 1. node 0 is gone: its ranks restore from node 1's replicas, nothing read remotely
    shutil.rmtree(node0)
    got = launch("restore", args)
    check(got)
    assert [g["remote_gets"] for g in got] == [0] * WORLD
    assert set(got[0]["sources"].values()) == {"rank 2 (replica)"}
    assert set(got[1]["sources"].values()) == {"rank 2 (replica)", "rank 3 (replica)"}
    for r in (2, 3):  # rank 0's model: from the copy node 1 holds; their own files: local
        model = "runs/tiered/versions/v000003/model.mckp"
        assert got[r]["sources"].pop(model) == "local replica"
        assert set(got[r]["sources"].values()) == {"local"}

    # 1b. node 0 gone again and the bucket holds nothing of the run: a fresh job of the README's
    # quickstart (from_toml, await manager.restore("latest")) recovers from node 1's replicas
    shutil.rmtree(node0)
    assert _move(moto, prefix + "/", prefix + "-aside/") > 0
    got = launch("quickstart", args)
    check(got)
    assert set(got[0]["sources"].values()) == {"rank 2 (replica)"}
    assert set(got[1]["sources"].values()) == {"rank 2 (replica)", "rank 3 (replica)"}
    assert not any("remote" in g["sources"].values() for g in got)
    assert moto.objects(prefix + "/") == []  # the restore wrote nothing to the remote
    _move(moto, prefix + "-aside/", prefix + "/")

    # 2. node 0 gone again and rank 0's optimizer replica damaged: that blob from the remote.
    # Checked twice: the copy hashed on arrival (small files are), and, with nothing hashed
    # on arrival, caught by rank 0's reader: every rank joins the repair round, rank 0
    # restores again
    bad = node1 / "replica/runs/tiered/versions/v000003/opt_shard_rank0000.bin"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    for small in (None, 0):
        shutil.rmtree(node0)
        bad.write_bytes(bytes(data))
        got = launch("restore", {**args, "small": small})
        check(got)
        src0 = got[0]["sources"]
        assert src0["runs/tiered/versions/v000003/opt_shard_rank0000.bin"] == "remote"
        assert sum(v == "remote" for v in src0.values()) == 1
        assert got[0]["remote_gets"] == 1
        assert [g["remote_gets"] for g in got[1:]] == [0] * (WORLD - 1)
        assert all(("repair 1" in g["phases"]) == (small == 0) for g in got), small

    # 3. both nodes gone: everything from the remote tier
    shutil.rmtree(node0)
    shutil.rmtree(node1)
    got = launch("restore", args)
    check(got)
    for r in range(WORLD):
        assert set(got[r]["sources"].values()) == {"remote"}
        assert got[r]["remote_gets"] >= 2


def test_unreadable_file_and_second_replica_holder(tmp_path: Path) -> None:
    """3 nodes, replicas = 2, no remote. Saving: on rank 0 every read of v000002's optimizer
    shard fails with EIO: v000002's replication fails for that file, reported on every rank
    (its owner could not read it, both holders did not get it), while the exchange completes
    (nobody waits for a deadline, the tier group stays usable) and v000003 replicates. Then
    node 0 is lost and node 1's copy of that shard of v000003 is gone: rank 0 gets it from
    its second replica holder (node 2), every other file from the first, bit for bit."""
    out = tmp_path / "out"
    out.mkdir()
    shard = "versions/v000002/opt_shard_rank0000.bin"
    args: dict[str, Any] = {"local": str(tmp_path / "node{node}"), "env": {}, "out": str(out),
                            "compress": True, "lws": 1, "replicas": 2, "timeout": 30,
                            "eio": [0, shard]}
    saved = launch("save", args, world=3)
    for r, s in enumerate(saved):
        assert s["errors"]["v000001"] == {} and s["errors"]["v000003"] == {}, (r, s["errors"])
        assert "replicated" in s["reached"]["v000003"], r
        err = s["errors"]["v000002"]
        assert set(err) == {"replicated"} and shard in err["replicated"], (r, err)
        assert "unusable" not in err["replicated"] and "failed within" not in err["replicated"]
    errors = saved[0]["errors"]["v000002"]["replicated"]
    assert "rank 0: cannot read" in errors and "Input/output error" in errors
    assert "rank 1: " in errors and "rank 2: " in errors  # both holders learnt it is missing

    v3 = "runs/tiered/versions/v000003"
    shutil.rmtree(tmp_path / "node0")
    (tmp_path / "node1" / "replica" / v3 / "opt_shard_rank0000.bin").unlink()
    got = launch("restore", {k: v for k, v in args.items() if k != "eio"}, world=3)
    for r in range(3):
        assert got[r]["step"] == 3
        assert _same(got[r]["snap"], saved[r]["snap"][3]), f"rank {r} state differs"
        assert torch.equal(got[r]["next_rand"], saved[r]["next_rand"][3]), f"rank {r} RNG"
    src0 = got[0]["sources"]
    assert src0.pop(f"{v3}/opt_shard_rank0000.bin") == "rank 2 (replica)"
    assert set(src0.values()) == {"rank 1 (replica)"}
