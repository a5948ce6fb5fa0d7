"""The tier layer in one process: config and node mapping, bad input at construction, the
save reaching each tier, per-tier retention and recovery falling through tier by tier."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, parse_config
from mithril_async.errors import ConfigError, StorageError
from mithril_async.manifest import BlobRef, VersionManifest
from mithril_async.restore.plan import make_plan
from mithril_async.restore.reshard import Box
from mithril_async.sharded import ShardTarget
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore
from mithril_async.tiers import NodeMap, TiersConfig
from mithril_async.tiers.commit import VersionMeta
from mithril_async.tiers.files import Need, files_to_restore, owned_files, owner_of
from mithril_async.tiers.layer import TierLayer
from mithril_async.tiers.replicate import replicate
from mithril_async.tiers.sources import OWN_FOLDER, REMOTE
from mithril_async.tiers.transport import Payload
from tests.ranks import free_port
from tests.tiers._state import tier_config, tiered, tiny_state, train_step


# ---------------------------------------------------------------- node mapping
def test_nodes_from_local_world_size_and_replica_jump() -> None:
    nm = NodeMap.from_local_world_size(8, 2)
    assert nm.nodes == 4 and nm.node_of == (0, 0, 1, 1, 2, 2, 3, 3)
    # the same local rank on the next node; the last node wraps to node 0
    assert nm.replica_holders(0, 1) == [2]
    assert nm.replica_holders(3, 1) == [5]
    assert nm.replica_holders(7, 1) == [1]
    assert nm.replica_holders(1, 2) == [3, 5]
    assert nm.replicated_by(2, 1) == [0]
    assert nm.replicated_by(0, 1) == [6]
    assert nm.is_lead(4) and not nm.is_lead(5)


def test_nodes_from_hostnames_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    nm = NodeMap.from_hostnames(["b", "b", "a", "a", "a"])
    assert nm.node_of == (0, 0, 1, 1, 1)
    # uneven nodes: local rank 2 of node 1 has no twin on node 0: local rank 2 mod 2 = 0
    assert nm.replica_holders(4, 1) == [0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert NodeMap.from_env(4, ["x"] * 4).node_of == (0, 0, 1, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE = 3"):
        NodeMap.from_env(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="not an integer"):
        NodeMap.from_env(4)


def test_replicas_must_be_fewer_than_nodes() -> None:
    nm = NodeMap.from_local_world_size(4, 2)
    with pytest.raises(ConfigError, match=r"tiers.replicas = 2 needs at least 3 nodes"):
        nm.replica_holders(0, 2)
    assert nm.replica_holders(0, 0) == []


# ---------------------------------------------------------------- config
def test_config_template_and_errors(tmp_path: Path) -> None:
    cfg = TiersConfig.from_mapping({"local": str(tmp_path / "n{node}" / "r{rank}")})
    assert cfg.replicas == 1 and cfg.keep_local == 2
    assert cfg.local_path(3, 7) == tmp_path / "n3" / "r7"
    assert cfg.anchor() == tmp_path
    with pytest.raises(ConfigError, match=r"checkpointing.tiers.replicas"):
        TiersConfig.from_mapping({"local": "/x", "replicas": -1})
    with pytest.raises(ConfigError, match=r"checkpointing.tiers.locl"):
        TiersConfig.from_mapping({"locl": "/x"})
    with pytest.raises(ConfigError, match=r"unknown placeholder\(s\) \{host\}"):
        TiersConfig.from_mapping({"local": "/x/{host}"})


def _config(tmp: Path, **extra: str) -> Any:
    return parse_config('[checkpointing]\nruns_path = "runs"\nrun_id = "r1"\n'
                        "[checkpointing.compression]\nthreads = 1\n"
                        + "".join(f"{k} = {v}\n" for k, v in extra.items()))


def _manager(config: Any, table: dict[str, Any], remote: Any = None) -> CheckpointManager:
    """A manager saving through the tiers ``table`` describes, over ``config``."""
    return CheckpointManager(tier_config(table, config), tiny_state(1), tier_remote=remote)


def test_bad_local_path_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers.local = .*missing.* does not exist"):
        _manager(_config(tmp_path), {"local": str(tmp_path / "missing" / "{node}"),
                                     "replicas": 0})
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"is not a directory"):
        _manager(_config(tmp_path), {"local": str(afile / "{node}"), "replicas": 0})
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=r"is not writable"):
            _manager(_config(tmp_path), {"local": str(ro), "replicas": 0})


def test_one_node_cannot_hold_a_replica(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"replicas = 1 needs at least 2 nodes; this job has 1"):
        _manager(_config(tmp_path), {"local": str(tmp_path / "{node}")})


def test_delta_chains_are_refused(tmp_path: Path) -> None:
    cfg = parse_config('[checkpointing]\nruns_path = "runs"\n'
                       "[checkpointing.compression]\ndelta = true\n")
    with pytest.raises(ConfigError, match=r"compression.delta"):
        _manager(cfg, {"local": str(tmp_path), "replicas": 0})


def test_remote_only_mode_is_refused(tmp_path: Path) -> None:
    cfg = parse_config('[checkpointing]\nruns_path = "runs"\n[checkpointing.remote]\n'
                       'bucket = "bkt"\nmode = "remote_only"\n')
    with pytest.raises(ConfigError, match=r"remote.mode = 'remote_only' does not combine"):
        _manager(cfg, {"local": str(tmp_path), "replicas": 0})


def test_unreachable_remote_is_a_storage_error_at_start(tmp_path: Path) -> None:
    port = free_port()  # a port nobody listens on
    cfg = parse_config('[checkpointing]\nruns_path = "runs"\n[checkpointing.remote]\n'
                       f'bucket = "nobucket"\nendpoint_url = "http://127.0.0.1:{port}"\n'
                       "max_attempts = 1\n")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    with pytest.raises(StorageError, match=rf"remote tier s3://nobucket/ at http://127.0.0.1:{port}"
                                           r" is unreachable at start"):
        _manager(cfg, {"local": str(tmp_path), "replicas": 0, "commit_timeout_s": 20})


# ---------------------------------------------------------------- one process, end to end


def _model(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def test_single_process_tiers_save_retention_and_fallthrough(tmp_path: Path) -> None:
    remote = MemoryStore()
    table = {"local": str(tmp_path / "node{node}"), "replicas": 0, "keep_local": 2}
    state = tiny_state(1)
    mgr = CheckpointManager(tier_config(table, _config(tmp_path)), state, tier_remote=remote)
    saved = {}
    for step in (1, 2, 3):
        train_step(state)
        res = mgr.save_nowait(step).result()
        assert res.status == "committed"
        saved[step] = _model(state)
    results = {r.version_id: r for r in _tiers(mgr).wait()}
    assert set(results) == {"v000001", "v000002", "v000003"}
    for r in results.values():
        assert set(r.reached) == {"local", "remote"} and r.errors == {}
        assert r.reached["remote"] >= r.reached["local"]
    root = tmp_path / "node0" / "runs" / "r1"
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v000002", "v000003"]
    assert {p.name for p in (root / "aliases").iterdir()} >= {"latest.json", "latest_local.json"}
    keys = asyncio.run(remote.list("runs/r1/"))
    assert "runs/r1/aliases/latest_remote.json" in keys
    assert sum(k.endswith("/manifest.json") for k in keys) == 3  # no keep_*: the remote keeps all
    mgr.close()

    # local blob damaged: that blob alone comes from the remote, the rest stays local
    blob = root / "versions" / "v000003" / "opt_shard_rank0000.bin"
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0x01
    blob.write_bytes(bytes(data))
    fresh = tiny_state(2)
    mgr = CheckpointManager(tier_config(table, _config(tmp_path)), fresh, tier_remote=remote)
    assert mgr.restore_sync() == 3
    assert _tiers(mgr).last_sources == {
        "runs/r1/config/train.toml": OWN_FOLDER,
        "runs/r1/versions/v000003/model.mckp": OWN_FOLDER,
        "runs/r1/versions/v000003/opt_shard_rank0000.bin": REMOTE,
        "runs/r1/versions/v000003/rng_rank0000.json": OWN_FOLDER}
    assert all(torch.equal(v, saved[3][k]) for k, v in _model(fresh).items())
    mgr.close()

    # the node is gone: everything from the remote, which kept every version
    import shutil
    shutil.rmtree(tmp_path / "node0")
    fresh = tiny_state(3)
    mgr = CheckpointManager(tier_config(table, _config(tmp_path)), fresh, tier_remote=remote)
    assert mgr.restore_sync() == 3
    assert set(_tiers(mgr).last_sources.values()) == {REMOTE}
    assert all(torch.equal(v, saved[3][k]) for k, v in _model(fresh).items())
    mgr.close()


def _tiers(mgr: CheckpointManager) -> TierLayer:
    assert mgr.tiers is not None
    return mgr.tiers


def test_failed_upload_is_reported_and_keeps_the_local_commit(tmp_path: Path) -> None:
    remote = MemoryStore()
    state = tiny_state(1)
    mgr = tiered({"local": str(tmp_path / "n{node}"), "replicas": 0}, state, remote)
    train_step(state)
    remote.inject_fault("put_if_absent", StorageError("injected: bucket full"), times=1)
    assert mgr.save_nowait(1).result().status == "committed"
    (res,) = _tiers(mgr).wait()
    assert set(res.reached) == {"local"}
    assert "rank 0" in res.errors["remote"] and "bucket full" in res.errors["remote"]
    assert (tmp_path / "n0/runs/r1/versions/v000001/manifest.json").exists()
    assert mgr.latest_step() == 1
    mgr.close()


def test_file_ownership_from_a_manifest(tmp_path: Path) -> None:
    assert owner_of("runs/r/versions/v000001/opt_shard_rank0003.bin") == 3
    assert owner_of("runs/r/versions/v000001/model.mckp") == 0
    state = tiny_state(1)
    mgr = tiered({"local": str(tmp_path), "replicas": 0}, state,
                 LocalStore(tmp_path / "remote"))
    mgr.save_nowait(1).result()
    _tiers(mgr).wait()
    m = mgr._bg(mgr.catalog.versions())[0]
    files = owned_files(m)
    assert set(files) == {0}
    assert {n.key.rsplit("/", 1)[1] for n in files[0]} == {
        "model.mckp", "opt_shard_rank0000.bin", "rng_rank0000.json"}
    assert all(n.xxh64 for n in files_to_restore(m, None))
    mgr.close()


class _DeadPeerLink:
    """Rank 0 of two whose peer is gone: every send fails as gloo's deadline would."""

    rank, world_size = 0, 2

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj, None]

    def exchange(self, sends: list[tuple[int, int, Payload]], recvs: list[tuple[int, int]],
                 what: str) -> dict[int, bytes | memoryview]:
        from mithril_async.errors import DistributedError
        assert sends and not recvs  # rank 0 sends its blobs, holds nothing here
        raise DistributedError(f"rank 0/2: {what} failed within 1s")

    def close(self) -> None:
        return None


def test_replication_to_a_dead_peer_names_rank_and_tier(tmp_path: Path) -> None:
    from mithril_async.errors import DistributedError

    state = tiny_state(1)
    mgr = tiered({"local": str(tmp_path / "n{node}"), "replicas": 0}, state)
    mgr.save_nowait(1).result()
    m = mgr._bg(mgr.catalog.versions())[0]
    key = mgr.layout.manifest_key(1)
    meta = asyncio.run(VersionMeta.read(_tiers(mgr).store, key))
    layout = mgr.layout
    mgr.close()
    two = TierLayer(tier_config({"local": str(tmp_path / "n{node}"), "replicas": 1},
                            _config(tmp_path)), link=_DeadPeerLink(), node_map=NodeMap((0, 1)))
    two.ctx.layout = layout
    assert two.ctx.holders(0) == [1]
    want = (r"v000001: tier replicated failed: rank 0: DistributedError: .*"
            r"copies to/from rank\(s\) \[1\] \(tier replicated\)")
    with pytest.raises(DistributedError, match=want):
        asyncio.run(replicate(two.ctx, meta, m))
    two.close()


def test_tiers_table_in_the_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table alone turns the tiers on for the plain manager; a bad table is refused
    when the TOML is parsed; a remote tier store without the table is refused."""
    toml = tmp_path / "train.toml"
    toml.write_text(f'[checkpointing]\nruns_path = "runs"\n[checkpointing.tiers]\n'
                    f'local = "{tmp_path}/nvme/{{node}}"\nreplicas = 0\nkeep_local = 3\n')
    (tmp_path / "nvme").mkdir()
    mgr = CheckpointManager.from_toml(toml, tiny_state(1))
    tiers = _tiers(mgr)
    assert tiers.ctx.tcfg.keep_local == 3 and tiers.root == tmp_path / "nvme" / "0"
    assert mgr.store is tiers.store and (tmp_path / "nvme" / "0").is_dir()
    mgr.close()
    bad = '[checkpointing]\n[checkpointing.tiers]\nlocal = "/x"\nreplica = 1\n'
    with pytest.raises(ConfigError, match=r"checkpointing.tiers.replica: Extra inputs"):
        parse_config(bad)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpointing.tiers is not set"):
        CheckpointManager(parse_config("[checkpointing]\n"), tiny_state(1),
                          tier_remote=MemoryStore())


def test_fast_tier_keeps_the_last_remote_version_while_uploads_fail(tmp_path: Path) -> None:
    remote = MemoryStore()
    state = tiny_state(1)
    mgr = tiered({"local": str(tmp_path / "n{node}"), "replicas": 0, "keep_local": 1}, state,
                 remote)
    tiers = _tiers(mgr)
    versions = tmp_path / "n0" / "runs" / "r1" / "versions"
    mgr.save_nowait(1).result()
    tiers.wait()
    remote.inject_fault("put_if_absent", StorageError("injected: bucket unreachable"), times=2)
    for step in (2, 3):
        train_step(state)
        mgr.save_nowait(step).result()
        tiers.wait()
    res = tiers.results
    assert "remote" in res["v000001"].reached
    assert "remote" in res["v000002"].errors and "remote" in res["v000003"].errors
    # keep_local = 1 keeps v3, and v1 stays: the only version a lost node could come back to
    assert sorted(p.name for p in versions.iterdir()) == ["v000001", "v000003"]
    train_step(state)
    mgr.save_nowait(4).result()  # uploads work again: v4 is durable, v1 may go
    tiers.wait()
    assert "remote" in res["v000004"].reached
    assert sorted(p.name for p in versions.iterdir()) == ["v000004"]
    mgr.close()


def _sharded_manifest(world: int, rows: int = 8) -> Any:
    """A version saved by ``world`` ranks: a ``Shard(0)`` tensor ``w`` (``rows`` rows split
    evenly) and a replicated step counter, in optimizer shards; per-rank RNG files."""
    from mithril_async.manifest import (
        OptimizerEntry,
        PieceMeta,
        RankKey,
        ResumeInfo,
        RngEntry,
        ShardRef,
    )

    vdir = "runs/r/versions/v000003"
    per = rows // world
    shards = [ShardRef(key=f"{vdir}/opt_shard_rank{r:04d}.bin", rank=r, bytes=100 + r,
                       xxh64=f"{r:016x}", pieces={
                           "w": PieceMeta(global_shape=[rows, 2], offsets=[r * per, 0],
                                          lengths=[per, 2], dtype="float32"),
                           "step": PieceMeta(global_shape=[], offsets=[], lengths=[],
                                             dtype="float32", replicated=True)})
              for r in range(world)]
    return VersionManifest(
        run_id="r", version_id="v000003", created_at=datetime.now(UTC), step=3,
        world_size=world, resume=ResumeInfo(base_step=3, exact=True),
        model=BlobRef(key=f"{vdir}/model.mckp", bytes=10, xxh64="a" * 16),
        optimizer=OptimizerEntry(shards=shards),
        rng=RngEntry(keys=[RankKey(key=f"{vdir}/rng_rank{r:04d}.json", rank=r)
                           for r in range(world)]))


class _Targets:
    """A live state of data-loader states and sharded items whose targets ``fn`` gives
    (:class:`~mithril_async.restore.plan.LiveTargets`)."""

    has_json_states = True

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def reshard_targets(self, item: str, pieces: dict[str, Any]) -> dict[str, Any] | None:
        got: dict[str, Any] | None = self.fn(item, pieces)
        return got

    def in_place_targets(self, item: str) -> None:
        return None


def test_resharded_files_are_the_overlapping_saved_ranks() -> None:
    """4 saved ranks onto 2: each new rank fetches what its restore plan reads: the saved
    blobs its rows overlap, and the lowest saved rank's (skeleton, replicated step), every
    RNG file, the whole model; not the others. Without a plan (no targets, or one that
    fails) every saved blob, so the reader still finds what it needs and reports its own
    error."""
    m = _sharded_manifest(4)

    def targets_for(new_rank: int, world: int) -> Any:
        def targets(item: str, pieces: dict[str, Any]) -> dict[str, Any]:
            assert item == "optimizer" and set(pieces) == {"w", "step"}
            per = 8 // world
            w, step = torch.zeros(per, 2), torch.zeros(())
            return {"w": ShardTarget(w, w, Box.of([new_rank * per, 0], [per, 2]), (8, 2),
                                     torch.float32),
                    "step": ShardTarget(step, step, Box.of([], []), (), torch.float32)}
        return targets

    def files(rank: int, world: int, targets: Any) -> list[Need]:
        live = None if targets is None else _Targets(targets)
        return files_to_restore(m, lambda v: make_plan(v, rank=rank, world_size=world,
                                                        live=live))

    def blobs(needs: list[Any]) -> set[int]:
        return {n.owner for n in needs if "opt_shard" in n.key}

    for rank, want in ((0, {0, 1}), (1, {0, 2, 3})):
        needs = files(rank, 2, targets_for(rank, 2))
        assert blobs(needs) == want, rank
        assert sum("rng_rank" in n.key for n in needs) == 4
        assert any(n.key.endswith("model.mckp") for n in needs)
    assert blobs(files(0, 2, None)) == {0, 1, 2, 3}

    def broken(item: str, pieces: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("no live state")

    assert blobs(files(0, 2, broken)) == {0, 1, 2, 3}
    # the same world: its own files, plus the lowest rank's blob (skeleton, replicated
    # pieces), which the one reader reads for any restore from pieces
    same = files(2, 4, targets_for(2, 4))
    assert blobs(same) == {0, 2}
    assert [n.key.rsplit("/", 1)[1] for n in same if "rng" in n.key] == ["rng_rank0002.json"]
    assert blobs(files(2, 4, None)) == {2}  # no targets: as before


def test_tier_aliases_only_move_forward() -> None:
    """``latest_local`` / ``latest_replicated`` / ``latest_remote`` move with the catalog's
    compare-and-swap and never back to an older version."""
    from mithril_async.catalog import RunCatalog
    from mithril_async.layout import RunLayout

    cat = RunCatalog(MemoryStore(), RunLayout("runs", "r"))
    v3 = _sharded_manifest(2)
    v2 = v3.model_copy(update={"version_id": "v000002", "step": 2})
    assert asyncio.run(cat.move_alias("latest_local", v3, "runs/r/versions/v000003/m.json"))
    assert not asyncio.run(cat.move_alias("latest_local", v2, "runs/r/versions/v000002/m.json"))
    alias = asyncio.run(cat.read_alias("latest_local"))
    assert alias is not None and (alias.version_id, alias.step) == ("v000003", 3)
