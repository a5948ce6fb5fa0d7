"""TierLayer composed with elastic restore, in real processes over gloo; remote tier on moto.

A job of 4 ranks as 2 nodes (``LOCAL_WORLD_SIZE=2``) saves three versions of a sharded state
(DTensor ``Shard(0)``); node 0 (A) is lost and the job comes back with 2 ranks:

1. on 2 nodes, a fresh empty one in place of A and B (one rank each, replicas = 1, no remote
   tier at all), A lost while the last version was being replicated (B's replica folder
   lacks it): the newest version whose every needed file survives is taken (v000002), the
   new rank 0 gets saved ranks 0 and 1's blobs from B's replica folder over the tier group
   (a peer) and saved ranks 2 and 3's RNG files from B's own folder; then a save at the new
   size replicates between the two new nodes and restores again;
2. on 1 node, B's folder alone (replicas = 0: one node has no peer): every file from B's own
   and replica folders, but one damaged replica copy, caught by the reader and fetched
   from the remote alone (one GET); then a save at the new size (to the remote too)
   restores again at that size;
3. both folders gone: the 4-rank version restores from the remote at 2 ranks (the strict
   ``manager.tiers.recover``, which writes every fetched file into the new node folder).

Each resharded restore must give, bit for bit, the saved global tensors laid out on the new
mesh (the full-state oracle), with ``resume.exact`` false.
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
from tests.tiers._elastic_worker import run_rank

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.tiers._elastic_worker"])
V2, V3 = "runs/elastic/versions/v000002", "runs/elastic/versions/v000003"


def launch(scenario: str, args: dict[str, Any], world: int, timeout: float = 120
           ) -> list[dict[str, Any]]:
    codes = launch_ranks(_CTX, run_rank, world,
                         lambda r, port: (scenario, args, r, world, port), timeout)
    assert codes == [0] * world, scenario
    out = Path(args["out"])
    got = [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(world)]
    for r in range(world):
        (out / f"{scenario}_rank{r}.pt").unlink()
    return got


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_resharded(got: list[dict[str, Any]], step: int = 3) -> None:
    for r, g in enumerate(got):
        assert g["step"] == step
        assert g["resharded"] and not g["exact"], r
        assert len(g["local"]) == 12  # 3 parameters and their step, exp_avg, exp_avg_sq
        assert _equal(g["local"], g["oracle"]), f"rank {r}: local shards differ from the oracle"


def _blobs_of(sources: dict[str, str], saved_rank: int) -> set[str]:
    return {k for k in sources if k.endswith(f"_rank{saved_rank:04d}.bin")}


@pytest.fixture(scope="module")
def moto() -> Any:
    with MotoS3() as s3:
        yield s3


def test_node_loss_then_smaller_job(tmp_path: Path, moto: MotoS3) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prefix = moto.unique_prefix("elastic")
    base: dict[str, Any] = {"env": moto.env, "out": str(out)}
    remote = {"bucket": moto.bucket, "prefix": prefix, "endpoint": moto.endpoint_url}
    saved = launch("save", {**base, **remote, "local": str(tmp_path / "node{node}"),
                            "replicas": 1, "lws": 2}, 4)
    for s in saved:
        assert all(e == {} for e in s["errors"].values()), s["errors"]
        assert set(s["reached"]["v000003"]) == {"local", "replicated", "remote"}
    node_b = tmp_path / "node1"
    held = {p.name for p in (node_b / "replica" / V3).iterdir()}
    assert {"opt_shard_rank0000.bin", "opt_shard_rank0001.bin"} <= held
    shutil.rmtree(tmp_path / "node0")  # node A is gone

    # 1. 2 nodes (a fresh one, and B), one rank each: peers, no remote tier configured. A
    # died while v000003 was being replicated: B's replica folder lacks it, so the newest
    # version whose every file is on a surviving node is v000002
    peer = tmp_path / "peer"
    peer.mkdir()
    shutil.copytree(node_b, peer / "node1")
    shutil.rmtree(peer / "node1/replica" / V3)
    got = launch("restore", {**base, "local": str(peer / "node{node}"), "replicas": 1,
                             "lws": 1, "then_save": True}, 2)
    _check_resharded(got, step=2)
    src0, src1 = got[0]["sources"], got[1]["sources"]
    assert _blobs_of(src0, 0) and _blobs_of(src0, 1)
    assert not _blobs_of(src0, 2) and not _blobs_of(src0, 3)
    assert {src0[k] for k in _blobs_of(src0, 0) | _blobs_of(src0, 1)} == {"rank 1 (replica)"}
    # the state maps no data-loader states, so the restore reads only this rank's RNG file,
    # and the recovery fetches what the restore reads: no other rank's
    assert {k for k in src0 if "/rng_rank" in k} == {f"{V2}/rng_rank0000.json"}
    # the new rank 1 holds rows saved by ranks 2 and 3 (and takes rank 0's blob for the
    # skeleton and the replicated bias): saved rank 1's blobs are not fetched at all
    assert not _blobs_of(src1, 1)
    assert {src1[k] for k in _blobs_of(src1, 2) | _blobs_of(src1, 3)} == {"local"}
    assert {src1[k] for k in _blobs_of(src1, 0)} == {"local replica"}
    for r, g in enumerate(got):  # the next save at the new size, on both new nodes
        assert list(g["after"].values()) == [(["local", "replicated"], {})], r
        assert g["step2"] == 4 and g["exact2"], r
        assert _equal(g["local2"], g["saved4"]), f"rank {r}: v000004 restored differently"
    assert list(got[0]["after"]) == ["v000004"]  # numbered after B's v000003
    for n in (0, 1):  # keep_local = 2 at the new size too
        kept = sorted(p.name for p in (peer / f"node{n}/runs/elastic/versions").iterdir())
        assert kept == (["v000002", "v000004"] if n == 0 else ["v000003", "v000004"]), n
    for n, other in ((0, 1), (1, 0)):  # each node now holds the other rank's copy
        rep = {p.name for p in (peer / f"node{n}/replica/runs/elastic/versions/v000004"
                                ).iterdir()}
        assert f"opt_shard_rank{other:04d}.bin" in rep and \
            f"opt_shard_rank{n:04d}.bin" not in rep, (n, rep)

    # 2. 1 node: B's folder alone (both ranks share it); nothing of v000003 read remotely
    # but the one copy that is damaged: B's replica of saved rank 1's optimizer blob, which
    # only the new rank 0 reads; its reader catches it, both ranks join a repair round, and
    # that file alone comes from the remote
    bad_key = f"{V3}/opt_shard_rank0001.bin"
    bad = node_b / "replica" / bad_key
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    args = {**base, **remote, "local": str(node_b), "replicas": 0, "lws": 2}
    got = launch("restore", {**args, "then_save": True}, 2)
    _check_resharded(got)
    assert [g["remote_gets"] for g in got] == [1, 0]
    assert all("repair 1" in g["phases"] for g in got)
    src0, src1 = got[0]["sources"], got[1]["sources"]
    assert src0.pop(bad_key) == "remote"
    assert {src0[k] for k in _blobs_of(src0, 0) | _blobs_of(src0, 1)} == {"local replica"}
    assert not _blobs_of(src0, 2) and not _blobs_of(src0, 3) and not _blobs_of(src1, 1)
    assert {src1[k] for k in _blobs_of(src1, 2) | _blobs_of(src1, 3)} == {"local"}
    assert {src1[k] for k in _blobs_of(src1, 0)} == {"local replica"}
    for g in got:
        assert set(g["sources"].values()) <= {"local", "local replica"}
        assert g["after"]["v000004"] == (["local", "remote"], {})
        assert g["step2"] == 4 and g["exact2"]
        assert _equal(g["local2"], g["saved4"])
        assert set(g["sources2"].values()) == {"local"}

    assert sorted(p.name for p in (node_b / "runs/elastic/versions").iterdir()) == [
        "v000003", "v000004"]

    # 3. every local copy gone: the 4-rank version from the remote, at 2 ranks
    shutil.rmtree(node_b)
    node_b.mkdir()  # the new node's (empty) mount point
    got = launch("restore", {**args, "target": "v000003", "strict": True}, 2)
    _check_resharded(got)
    for g in got:
        assert set(g["sources"].values()) == {"remote"}
        assert g["remote_gets"] >= len(g["sources"])
    # the strict form wrote every fetched file into the (new) node folder, hashed
    v3 = node_b / V3
    assert {p.name for p in v3.iterdir()} >= {
        k.rsplit("/", 1)[1] for g in got for k in g["sources"] if k.startswith(V3)}
