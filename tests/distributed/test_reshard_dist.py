"""Resharded restores in real processes over gloo: DTensor state saved at 2 ranks restores at
4 (on a 2-D mesh), 3 and 1; saved at 4 (2-D mesh, uncompressed) it restores at 2. Oracle: the
same state saved with torch.distributed.checkpoint and loaded at the new world size gives
bitwise the same local shards. Bad input (a live shape that differs, a missing rank's blob)
raises before anything is written."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async.manifest import ShardRef, VersionManifest, parse_model
from tests.distributed._reshard_worker import run_rank
from tests.ranks import launch_ranks

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.distributed._reshard_worker"])


def launch(scenario: str, world: int, timeout: float = 180, **args: Any) -> list[int | None]:
    return launch_ranks(_CTX, run_rank, world,
                        lambda rank, port: (scenario, args, rank, world, port), timeout)


def _load(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world)]


def _saved(tmp: Path, world: int, **kw: Any) -> tuple[Path, Path, list[dict[str, Any]]]:
    runs, dcp_dir, out = tmp / "runs", tmp / "dcp", tmp / "out"
    out.mkdir()
    assert launch("save", world, runs=str(runs), dcp=str(dcp_dir), out=str(out), **kw) == [
        0] * world
    return runs, dcp_dir, _load(out, "saved", world)


@pytest.fixture(scope="module")
def from_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    runs, dcp_dir, saved = _saved(tmp_path_factory.mktemp("two"), 2)
    return runs, dcp_dir, saved


@pytest.fixture(scope="module")
def from_four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    runs, dcp_dir, saved = _saved(tmp_path_factory.mktemp("four"), 4, two_d=True,
                                  compress=False)
    return runs, dcp_dir, saved


def _restore(tmp: Path, runs: Path, dcp_dir: Path, world: int, **kw: Any
             ) -> list[dict[str, Any]]:
    out = tmp / f"out{world}"
    out.mkdir()
    assert launch("restore", world, runs=str(runs), dcp=str(dcp_dir), out=str(out),
                  **kw) == [0] * world
    return _load(out, "restored", world)


def _check(got: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    world, saved_world, full = len(got), len(saved), saved[0]["full"]
    for rank, seen in enumerate(got):
        assert seen["step"] == 5
        assert seen["exact"] is False and seen["resharded"] is True
        # the oracle: DCP's local shards at this world size, bit for bit
        assert set(seen["local"]) == set(seen["oracle"]) == set(full), rank
        for name, t in seen["local"].items():
            want = seen["oracle"][name]
            assert t.dtype == want.dtype and t.shape == want.shape, (rank, name)
            assert torch.equal(t, want), (rank, name)
        for name, t in seen["full"].items():  # and the global tensors are the saved ones
            assert torch.equal(t, full[name]), (rank, name)
        # DistributedSampler-style positions: the saved ranks consumed 10 + r each
        total = sum(10 + r for r in range(saved_world))
        assert seen["position"]["position"] == total // world
        # the RNG of a rank that existed is restored; a new rank's is reseeded, its own
        assert any(("rng: rank" in n) for n in seen["notes"]) == (rank >= saved_world)
        if rank < saved_world:
            assert torch.equal(seen["rand"], saved[rank]["rand"]), rank
    rands = [seen["rand"] for seen in got]
    assert all(not torch.equal(rands[i], rands[j])
               for i in range(world) for j in range(i + 1, world))


@pytest.mark.slow
def test_two_to_four_on_a_2d_mesh(tmp_path: Path, from_two: Any) -> None:
    runs, dcp_dir, saved = from_two
    _check(_restore(tmp_path, runs, dcp_dir, 4, two_d=True), saved)


@pytest.mark.slow
def test_two_to_three_uneven(tmp_path: Path, from_two: Any) -> None:
    runs, dcp_dir, saved = from_two
    got = _restore(tmp_path, runs, dcp_dir, 3)
    _check(got, saved)
    assert [s["local"]["w0"].shape[0] for s in got] == [3, 3, 1]  # 7 rows over 3 ranks


@pytest.mark.slow
def test_two_to_one(tmp_path: Path, from_two: Any) -> None:
    runs, dcp_dir, saved = from_two
    _check(_restore(tmp_path, runs, dcp_dir, 1), saved)


@pytest.mark.slow
def test_four_2d_uncompressed_to_two_and_bad_input(tmp_path: Path, from_four: Any) -> None:
    runs, dcp_dir, saved = from_four
    got = _restore(tmp_path, runs, dcp_dir, 2, bad=True)
    _check(got, saved)
    path = runs / "rs" / "versions" / "v000001" / "manifest.json"
    manifest = parse_model(VersionManifest, path.read_bytes(), str(path))
    assert manifest.optimizer is not None
    refs = manifest.extra["model"] + manifest.optimizer.shards
    # the DTensors' pieces are stored as piece layouts (torch's boxes, reproduced by the
    # mesh arithmetic on every rank), not one box per rank per tensor
    assert all(r.layout is not None and not r.pieces for r in refs)
    assert len(manifest.layouts) == 2

    def table(ref: ShardRef) -> dict[str, Any]:
        return {n: p.model_dump(mode="json") for n, p in ref.piece_table().items()}

    pieces = {s.rank: table(s) for s in manifest.extra["model"]}
    assert pieces[2]["w0"] == {"global_shape": [7, 6], "offsets": [4, 0], "lengths": [3, 3],
                               "dtype": "float32"}
    assert pieces[1]["w1"]["replicated"] is True  # Replicate on mesh dim 0
    opt = {s.rank: table(s) for s in manifest.optimizer.shards}
    assert opt[3]["state/w0/exp_avg"]["offsets"] == [4, 3]
    assert opt[3]["state/w0/step"] == {"global_shape": [], "offsets": [], "lengths": [],
                                       "dtype": "float32", "replicated": True}
    for seen in got:
        assert seen["shape_error"].startswith("ShapeMismatch") and "'w1'" in seen["shape_error"]
        assert "[4, 6]" in seen["shape_error"] and "[4, 5]" in seen["shape_error"]
        assert seen["shape_untouched"] is True
        # saved rank 2 holds b[2:3], which every new rank needs: named, nothing written
        assert seen["missing_error"].startswith("MissingPrevious"), seen["missing_error"]
        assert "model_shard_rank0002" in seen["missing_error"]
        assert seen["missing_untouched"] is True


@pytest.mark.slow
@pytest.mark.parametrize(("saved_world", "world"), [(4, 2)])
def test_fsdp2_fully_shard_reshards_like_dcp_and_trains_on(tmp_path: Path, saved_world: int,
                                                          world: int) -> None:
    """FSDP2 on CPU: saved at one world size, restored at another. Ours and DCP's restores
    give the same local shards, and the training continued from each, the same losses."""
    runs, dcp_dir, out = tmp_path / "runs", tmp_path / "dcp", tmp_path / "out"
    out.mkdir()
    args = {"runs": str(runs), "dcp": str(dcp_dir), "out": str(out)}
    assert launch("fsdp_save", saved_world, **args) == [0] * saved_world
    assert launch("fsdp_restore", world, **args) == [0] * world
    got = _load(out, "restored", world)
    for rank, seen in enumerate(got):
        assert seen["step"] == 2 and seen["exact"] is False
        assert set(seen["local"]) == set(seen["oracle"]) and len(seen["local"]) == 16
        for name, t in seen["local"].items():
            assert torch.equal(t, seen["oracle"][name]), (rank, name)
        assert seen["losses"] == seen["oracle_losses"], rank
    assert got[0]["local"]["0.weight"].shape[0] == 3  # 5 rows over 2 ranks: uneven
