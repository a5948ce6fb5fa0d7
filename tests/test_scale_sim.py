"""Many ranks in one process: the simulated coordinator, the counting store, the mesh
arithmetic of piece layouts, and the save + restore of 64 simulated ranks through them.

What must not grow with the world size is checked with counters, never with time: the
requests each rank makes per save, the saved pieces a rank's restore plan looks at per
tensor, the listings of a save (never the blobs of every kept version), the S3 prefix write
rate of a save at full size (every rank folder under S3's 3,500 writes per second).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard

import mithril_async.restore.plan as plan_module
from mithril_async import CheckpointManager
from mithril_async.catalog import RunCatalog
from mithril_async.config import config_from_dict
from mithril_async.errors import DistributedError, InvalidFormat, SaveFailed
from mithril_async.layout import RANKS_PER_FOLDER, RunLayout
from mithril_async.live import LiveState
from mithril_async.manifest import (
    MeshSplit,
    OptimizerEntry,
    PieceMeta,
    RankKey,
    ResumeInfo,
    RngEntry,
    ShardRef,
    VersionManifest,
    compact_pieces,
    dump_model,
    parse_model,
    utcnow,
)
from mithril_async.mesh_layout import mesh_box, overlapping
from mithril_async.restore.piece_index import PieceIndex
from mithril_async.restore.plan import make_plan
from mithril_async.restore.reshard import Box
from mithril_async.save.coordinator import RankPart, compact_part
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore
from mithril_async.testing.counting import WRITES, CountingStore
from mithril_async.testing.ranks import SimGroup
from mithril_async.testing.sharded import Mesh, SimShardedState, fsdp_state, mesh_for

GOLDEN = Path(__file__).parent / "golden" / "run_before_rank_folders"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ------------------------------------------------------------------ the simulated group
def test_a_broadcast_reaches_every_rank_and_a_gather_rank_0_across_threads() -> None:
    group = SimGroup(3)
    coords = [group.coordinator(r) for r in range(3)]
    results: dict[int, Any] = {}

    async def rank(r: int) -> None:  # each rank on its own thread and event loop
        sent = {"from": r}
        got = await coords[r]._collective("b", coords[r]._bcast_fn(sent if r == 0 else None))
        gathered = await coords[r]._collective("g", coords[r]._gather_fn({"rank": r}))
        results[r] = (got, gathered)

    threads = [threading.Thread(target=lambda r=r: run(rank(r))) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[0] == ({"from": 0}, [{"rank": 0}, {"rank": 1}, {"rank": 2}])
    assert results[1] == ({"from": 0}, None) and results[2] == ({"from": 0}, None)
    assert results[1][0] is not results[2][0]  # pickled: every rank gets its own copy
    assert group.completed == {"b": 1, "g": 1}


def test_ranks_out_of_step_fail_with_a_distributed_error() -> None:
    group = SimGroup(2)
    a, b = group.coordinator(0), group.coordinator(1)

    async def body() -> None:
        assert await a._collective("one", a._bcast_fn(1)) == 1  # rank 0 sends, goes on
        with pytest.raises(DistributedError, match="out of step"):
            await b._collective("other", b._gather_fn(2))
        with pytest.raises(DistributedError, match="unusable"):  # broken from now on
            await b._collective("one", b._bcast_fn(None))

    run(body())


def test_the_group_holds_rank_0_in_a_gather_until_released() -> None:
    group = SimGroup(2)
    group.hold("g")
    seen: list[str] = []
    zero = group.coordinator(0)
    done = threading.Event()

    def root() -> None:
        out = run(zero._collective("g", zero._gather_fn("a")))
        seen.append(f"root got {out}")
        done.set()

    t = threading.Thread(target=root)
    t.start()
    one = group.coordinator(1)
    assert run(one._collective("g", one._gather_fn("b"))) is None
    assert group.wait_arrived("g", 0, 30) and group.wait_arrived("g", 1, 30)
    assert not done.is_set() and group.arrived("g") == 2  # everyone is in; rank 0 waits
    group.release("g")
    t.join(30)
    assert seen == ["root got ['a', 'b']"]


# ------------------------------------------------------------------ the counting store
def test_the_counting_store_counts_requests_uploads_and_listings() -> None:
    store = CountingStore(MemoryStore(), part_bytes=100)
    r3, r4 = store.view(3), store.view(4)

    async def body() -> None:
        await r3.put("a/b/x.json", b"12")
        async with r3.open_writer("a/b/small.bin") as w:  # under one part: one PUT
            await w.write(b"x" * 60)
        async with r4.open_writer("a/c/big.bin") as w:  # 250 bytes: 3 parts
            for _ in range(5):
                await w.write(b"y" * 50)
        await r4.stand_in_upload("a/c/other.bin", b"z" * 250)  # counted the same way
        assert await r3.list("a/") == ["a/b/small.bin", "a/b/x.json", "a/c/big.bin",
                                        "a/c/other.bin"]
        assert (await r3.list_dir("a")).dirs == ["b", "c"]
        assert await store.inner.get("a/c/other.bin") == b"z" * 250

    run(body())
    log = store.log
    assert log.by_kind == Counter({"put": 2, "upload_create": 2, "upload_part": 6,
                                   "upload_complete": 2, "list": 1, "list_dir": 1})
    assert log.of_rank(3) == 4 and log.of_rank(4, WRITES) == 10
    assert log.per_prefix(WRITES) == Counter({"a/b": 2, "a/c": 10})
    assert log.busiest(WRITES) == ("a/c", 10)
    assert log.listings == [("list", "a", 4), ("list_dir", "a", 2)] and log.listed_keys() == 6
    # rank 3 wrote 62 bytes in a/b, rank 4 500 in a/c: at 1,000 bytes/s in 100-byte parts
    # each sends 10 parts per second, all of them into its one folder
    assert log.modelled_write_rate(100, 1000.0) == {"a/b": 10.0, "a/c": 10.0}


def test_the_modelled_rate_splits_a_rank_between_its_prefixes() -> None:
    store = CountingStore(MemoryStore())

    async def body() -> None:
        for r, key, n in ((0, "p/x", 300), (0, "q/x", 100), (1, "q/y", 50)):
            await store.view(r).put(key, b"0" * n)

    run(body())
    rates = store.log.modelled_write_rate(8 << 20, 8 * (1 << 20) * 4.0)  # 4 parts/s a rank
    assert rates == {"p": 3.0, "q": 1.0 + 4.0}


# ------------------------------------------------------------------ mesh arithmetic
def _meshes() -> Iterator[tuple[list[int], list[int], list[int | None]]]:
    rnd = random.Random(7)
    for _ in range(300):
        nd = rnd.randint(0, 3)
        shape = [rnd.randint(0, 11) for _ in range(nd)]
        mesh = [rnd.randint(1, 4) for _ in range(rnd.randint(1, 3))]
        dims = [rnd.choice([None, *range(nd)]) for _ in mesh]
        yield shape, mesh, dims


def test_mesh_box_is_the_box_torch_gives_every_rank() -> None:
    for shape, mesh, dims in _meshes():
        placements = [Replicate() if d is None else Shard(d) for d in dims]
        for coord in itertools.product(*(range(n) for n in mesh)):
            lengths, offsets = _compute_local_shape_and_global_offset(shape, mesh,
                                                                      list(coord), placements)
            assert mesh_box(shape, mesh, dims, coord) == (tuple(offsets), tuple(lengths)), \
                (shape, mesh, dims, coord)


def test_overlapping_finds_exactly_the_non_empty_pieces_a_box_touches() -> None:
    rnd = random.Random(11)
    for shape, mesh, dims in _meshes():
        boxes = {c: mesh_box(shape, mesh, dims, c)
                 for c in itertools.product(*(range(n) for n in mesh))}
        for _ in range(4):
            off = [rnd.randint(0, s) for s in shape]
            ln = [rnd.randint(0, s - o) for s, o in zip(shape, off, strict=True)]
            need = Box(tuple(off), tuple(ln))

            want = {_sharded(c, dims) for c, (o, n) in boxes.items()
                    if all(n) and Box(o, n).intersect(need) is not None}
            got = {tuple(sel.get(i) for i in range(len(mesh)))
                   for sel in overlapping(shape, mesh, dims, off, ln)}
            assert got == want, (shape, mesh, dims, off, ln)


def _sharded(coord: tuple[int, ...], dims: list[int | None]) -> tuple[int | None, ...]:
    """``coord`` on the mesh dimensions that chunk the tensor (None on the others)."""
    return tuple(c if d is not None else None for c, d in zip(coord, dims, strict=True))


# ------------------------------------------------------------------ piece layouts
def _pieces(state: SimShardedState) -> dict[str, PieceMeta]:
    return {n: state.piece(n) for n in state.plans}


def _dumped(pieces: dict[str, PieceMeta]) -> dict[str, Any]:
    """Pieces as a manifest lists them (how they arose from a mesh is never stored)."""
    return {n: p.model_dump(mode="json") for n, p in pieces.items()}


def test_a_ranks_pieces_become_a_shared_layout_and_its_coordinate() -> None:
    mesh = mesh_for(8, tp=2)
    layouts = set()
    for r in range(8):
        model, opt = fsdp_state(3, mesh, r)
        for state in (model, opt):
            got = compact_pieces(_pieces(state))
            assert got is not None
            layout, coord = got
            assert coord == list(mesh.coord(r))
            assert _dumped({n: layout.piece(n, coord) for n in layout.tensors}) == \
                _dumped(_pieces(state))
            layouts.add(layout.layout_id())
    assert len(layouts) == 2  # one for the model, one for the optimizer, whatever the rank


def test_pieces_no_mesh_explains_stay_listed() -> None:
    model, _ = fsdp_state(2, Mesh((4,)), 1)
    pieces = _pieces(model)
    name = next(iter(pieces))
    p = pieces[name]
    assert p.split is not None
    lying = p.model_copy(update={"split": MeshSplit(mesh=[4], dims=[0], coord=[2])})
    assert compact_pieces({**pieces, name: lying}) is None  # the split does not give the box
    partial = p.model_copy(update={"split": None})  # a box without a mesh, not the whole
    assert compact_pieces({**pieces, name: partial}) is None
    other = p.model_copy(update={"split": MeshSplit(mesh=[2, 2], dims=[0, None],
                                                    coord=[0, 1])})
    assert compact_pieces({**pieces, name: other}) is None  # two meshes in one item
    part = RankPart(rank=1, shards={"model": ShardRef(
        rank=1, key="runs/r/versions/v000001/m.bin", bytes=1, xxh64="0" * 16,
        pieces={**pieces, name: lying})})
    assert compact_part(part) is part  # sent as it is: every piece listed


def _manifest(n: int, params: int = 2, mesh: Mesh | None = None) -> VersionManifest:
    """A committed-looking manifest of ``n`` sim ranks, built without saving anything."""
    mesh = mesh or mesh_for(n)
    lay = RunLayout("runs", "sim")
    model, opt = fsdp_state(params, mesh, 0)
    parts = {}
    for item, state in (("model", model), ("optimizer", opt)):
        got = compact_pieces(_pieces(state))
        assert got is not None
        parts[item] = got[0]
    ids = {item: layout.layout_id() for item, layout in parts.items()}

    def ref(item: str, r: int) -> ShardRef:
        return ShardRef(key=lay.shard_key(1, item, r), bytes=1, xxh64="0" * 16, rank=r,
                        layout=ids[item], coord=list(mesh.coord(r)))

    models = [ref("model", r) for r in range(n)]
    return VersionManifest(
        run_id="sim", version_id="v000001", created_at=utcnow(), step=1, world_size=n,
        model=models[0].model_dump(exclude={"rank"}),
        optimizer=OptimizerEntry(shards=[ref("optimizer", r) for r in range(n)]),
        rng=RngEntry(keys=[RankKey(key=lay.rng_key(1, r), rank=r) for r in range(n)]),
        extra={"model": models}, resume=ResumeInfo(base_step=1, exact=True),
        layouts={ids[i]: parts[i] for i in parts})


def test_a_manifest_refuses_blobs_whose_layout_it_does_not_hold() -> None:
    m = _manifest(4)
    good = dump_model(m)
    assert parse_model(VersionManifest, good, "m").extra["model"][3].piece_table() == \
        m.extra["model"][3].piece_table()
    bad = {"unknown layout": lambda d: d["extra"]["model"][1].update(layout="f" * 16),
           "off the mesh": lambda d: d["extra"]["model"][1].update(coord=[4]),
           "short coordinate": lambda d: d["extra"]["model"][1].update(coord=[]),
           "pieces too": lambda d: d["extra"]["model"][1].update(pieces={"x": {
               "global_shape": [1], "offsets": [0], "lengths": [1], "dtype": "float32"}})}
    for why, spoil in bad.items():
        d = m.model_dump(mode="json")
        spoil(d)
        with pytest.raises(InvalidFormat, match="does not match"):
            parse_model(VersionManifest, json.dumps(d).encode(), why)


def test_the_piece_index_finds_what_looking_through_every_piece_finds() -> None:
    rnd = random.Random(3)
    for world, tp in ((8, 1), (12, 1), (8, 2), (12, 4)):
        saved = mesh_for(world, tp)
        m = _manifest(world, mesh=saved)
        layout_refs = {s.rank: s for s in m.optimizer.shards} if m.optimizer else {}
        listed = {r: s.with_pieces() for r, s in layout_refs.items()}
        fast, slow = PieceIndex(layout_refs), PieceIndex(listed)
        _, opt = fsdp_state(2, saved, 0)
        for name, plan in opt.plans.items():
            for _ in range(6):
                off = [rnd.randint(0, s) for s in plan.global_shape]
                ln = [rnd.randint(0, s - o) for s, o in zip(plan.global_shape, off,
                                                             strict=True)]
                need = Box(tuple(off), tuple(ln))
                a = {(p.rank, p.box) for p in fast.overlapping(name, need)}
                # looking through every piece: the lowest rank of each box that overlaps
                b: dict[Box, int] = {}
                for p in slow.overlapping(name, need):
                    if all(p.box.lengths) and p.box.intersect(need) is not None:
                        b[p.box] = min(b.get(p.box, p.rank), p.rank)
                assert a == {(r, box) for box, r in b.items()}, (world, tp, name, need)
        assert fast.shape_mismatch("state/layers.0.weight/exp_avg", [1, 1]) == \
            (0, list(opt.plans["state/layers.0.weight/exp_avg"].global_shape))


@contextmanager
def _pieces_looked_at() -> Iterator[list[int]]:
    """How many saved pieces the restore plan hands the overlap check, per tensor."""
    seen: list[int] = []
    real = plan_module.plan_reads

    def counting(name: str, need: Box, pieces: Any) -> Any:
        seen.append(len(pieces))
        return real(name, need, pieces)

    plan_module.plan_reads = counting  # type: ignore[assignment]
    try:
        yield seen
    finally:
        plan_module.plan_reads = real  # type: ignore[assignment]


def _plan_work(saved_world: int, world: int, rank: int) -> list[int]:
    m = _manifest(saved_world)
    model, opt = fsdp_state(2, mesh_for(world), rank, saved_mesh=mesh_for(saved_world))
    states = {"model": model, "optimizer": opt}
    with _pieces_looked_at() as seen:
        make_plan(m, rank=rank, world_size=world, rng=False, live=LiveState(states))
    return seen


class _Loader:
    """A data loader's position (``get_state`` / ``set_state``)."""

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        pass


def test_a_reshard_reads_every_saved_ranks_state_file_only_for_data_loader_states() -> None:
    m = _manifest(64)

    def rng_ranks(world: int, rank: int, all_rank_states: bool) -> tuple[int, ...]:
        model, opt = fsdp_state(2, mesh_for(world), rank, saved_mesh=mesh_for(64))
        states: dict[str, Any] = {"model": model, "optimizer": opt}
        if all_rank_states:  # a data-loader state: a reshard maps every saved rank's
            states["loader"] = _Loader()
        return make_plan(m, rank=rank, world_size=world, live=LiveState(states)).rng_ranks

    assert rng_ranks(32, 5, True) == tuple(range(64))  # on_reshard gets every saved rank's
    assert rng_ranks(32, 5, False) == (5,)
    assert rng_ranks(128, 100, False) == (0,)  # a new rank: reseeded from the lowest
    assert rng_ranks(64, 7, True) == (7,)  # the same layout: its own, whatever the state


def test_a_ranks_restore_plan_looks_at_the_same_pieces_whatever_the_world_size() -> None:
    for factor, most in ((1, 1), (0.5, 2), (2, 1)):  # same world, N -> N/2, N -> 2N
        small = _plan_work(8, int(8 * factor), 1)
        big = _plan_work(4096, int(4096 * factor), 1)
        assert small == big and max(big) == most, (factor, small, big)


# ------------------------------------------------------------------ 64 ranks, saved and restored
@dataclass
class Job:
    store: CountingStore
    group: SimGroup
    managers: list[CheckpointManager]
    mesh: Mesh


def _config(keep: int = 2) -> Any:
    return config_from_dict({"checkpointing": {"run_id": "sim", "runs_path": "runs",
                                               "keep_last": keep,
                                               "compression": {"threads": 1}}})


@contextmanager
def _job(n: int, store: Any = None, params: int = 2) -> Iterator[Job]:
    counting = CountingStore(store or MemoryStore())
    group = SimGroup(n)
    mesh = mesh_for(n)
    managers = []
    try:
        for r in range(n):
            model, opt = fsdp_state(params, mesh, r)
            managers.append(CheckpointManager(
                _config(), {"model": model, "optimizer": opt}, store=counting.view(r),
                runs_prefix="runs", coordinator=group.coordinator(r), sharded_model=True))
        for m in managers:  # started before any save: no rank's start sees rank 0's claim
            m.latest_step()
        yield Job(counting, group, managers, mesh)
    finally:
        for m in managers:
            m.close()


def _save(job: Job, step: int) -> None:
    job.store.log.clear()
    handles = [m.save_nowait(step) for m in job.managers]
    for h in handles:
        assert h.result().status == "committed"


def _restore(store: Any, saved: Mesh, world: int, rank: int, params: int = 2
             ) -> tuple[list[str], CountingStore]:
    counting = CountingStore(store)
    model, opt = fsdp_state(params, mesh_for(world), rank, saved_mesh=saved)
    model.scramble()
    opt.scramble()
    with CheckpointManager(_config(), {"model": model, "optimizer": opt}, store=counting,
                           runs_prefix="runs", coordinator=SimGroup(world).coordinator(rank),
                           sharded_model=True) as m:
        m.restore_sync("latest")
    return model.mismatches() + opt.mismatches(), counting


def _rank_requests(job: Job, rank: int) -> Counter[str]:
    return Counter({k: n for (r, k), n in job.store.log.by_rank.items() if r == rank})


@pytest.mark.filterwarnings("ignore")
def test_64_ranks_save_and_restore_on_any_world_size_with_flat_costs() -> None:
    per_rank_small = {}
    with _job(8) as small:
        for step in (1, 2, 3):
            _save(small, step)
            per_rank_small[step] = _rank_requests(small, 5)
    with _job(64) as job:
        log = job.store.log
        for step in (1, 2, 3):  # keep_last = 2: the third save deletes the first version
            _save(job, step)
            # every rank but 0 makes the same requests as in an 8-rank job (its three files)
            assert _rank_requests(job, 5) == _rank_requests(job, 63) == per_rank_small[step]
            # rank 0 checks the 192 files of the version with one sized listing of its
            # folder, not a request per file
            lay = job.managers[0].layout
            assert log.by_prefix[lay.version_dir(step), "size"] <= 2  # claim, manifest
            # a save lists one level of versions/ (folder names), never every kept blob:
            # the recursive listings are of its own folder (the pre-commit check) and of the
            # version retention deletes
            recursive = {p for kind, p, _ in log.listings if kind == "list"}
            assert recursive == {lay.version_dir(step)} | (
                {lay.version_dir(1)} if step == 3 else set())
            versions = lay.versions_prefix.rstrip("/")
            assert all(n <= 4 for kind, p, n in log.listings
                       if kind == "list_dir" and p == versions)
            # ranks write into folders of 16: at 1 GB/s per rank in 8 MiB parts, no S3
            # prefix gets over its 3,500 writes per second (one folder would get ~7,600)
            rates = log.modelled_write_rate(8 << 20, 1e9)
            busy = {p for p, r in rates.items() if r > 100}  # not aliases, run.json, ...
            assert len(busy) == 64 // RANKS_PER_FOLDER and max(rates.values()) < 3500
        store, mesh = job.store.inner, job.mesh
    for world in (64, 32, 128):
        for rank in sorted({0, world // 2 + 1, world - 1}):
            with _pieces_looked_at() as seen:
                bad, counting = _restore(store, mesh, world, rank)
            assert bad == [], (world, rank, bad)
            assert seen and max(seen) <= (2 if world == 32 else 1)
            # its own pieces' blobs and the lowest rank's (the skeleton), of each item
            blobs = {k for k in counting.log.read_keys if k.endswith(".bin")}
            assert 2 <= len(blobs) <= 6, sorted(blobs)
            # no data-loader state to map: one RNG file, its own or (a new rank) rank 0's
            rng = {k.rsplit("/", 1)[-1] for k in counting.log.read_keys if "rng_rank" in k}
            assert rng == {f"rng_rank{rank if rank < 64 else 0:04d}.json"}, rng


def test_a_run_written_before_rank_folders_and_piece_layouts_restores(tmp_path: Path) -> None:
    """A 17-rank sharded run the library wrote before rank folders and piece layouts (every
    file in the version folder, every piece listed per rank) restores on 17, 8 and 34 ranks,
    bit for bit."""
    shutil.copytree(GOLDEN, tmp_path / "golden")  # a manager may write (aliases): a copy
    store = LocalStore(tmp_path / "golden")
    manifest = tmp_path / "golden" / "runs" / "sim" / "versions" / "v000001" / "manifest.json"
    m = parse_model(VersionManifest, manifest.read_bytes(), str(manifest))
    assert m.world_size == 17 and not m.layouts
    assert all(s.pieces and s.key.rsplit("/", 2)[1] == "v000001" for s in m.extra["model"])
    for world, rank in ((17, 16), (8, 7), (34, 33), (34, 0)):
        bad, _ = _restore(store, mesh_for(17), world, rank)
        assert bad == [], (world, rank, bad)
    assert run(RunCatalog(store, RunLayout("runs", "sim")).version_numbers()) == {1: True}


def test_a_blob_removed_or_resized_before_the_commit_publishes_nothing() -> None:
    """Rank 0 checks every file of the version by one sized listing of its folder (no
    request per file), and still refuses a blob another process removed or replaced."""
    with _job(4) as job:
        _save(job, 1)
        inner = job.store.inner
        for step, why in ((2, "was removed before its commit"), (3, "has 3 bytes")):
            job.store.log.clear()
            job.group.forget()
            job.group.hold("gather_parts")
            handles = [m.save_nowait(step) for m in job.managers]
            for r in range(4):
                assert job.group.wait_arrived("gather_parts", r, 60)
            key = job.managers[0].layout.shard_key(2, "model", 2)
            if step == 2:
                run(inner.delete(key))
            else:
                run(inner.put(key, b"abc"))
            job.group.release("gather_parts")
            for h in handles:  # every rank learns rank 0's verdict
                with pytest.raises(DistributedError, match=why):
                    h.result()
            for m in job.managers:  # reported to the caller: the next save may go on
                with contextlib.suppress(SaveFailed):
                    m.check_for_errors()
            # the folder was listed instead of asking each of its 12 files' size (the one
            # size request there is the claim's, read before it is trusted)
            folder = job.managers[0].layout.version_dir(2)
            assert job.store.log.by_prefix[folder, "size"] == 1
            # the failed save left nothing: rank 0 emptied the folder, every other rank
            # deleted its own files without listing anyone else's
            assert run(inner.list(folder + "/")) == []
            assert all(job.store.log.by_rank[r, "list"] == 0 for r in (1, 2, 3))
        _save(job, 4)
        assert job.managers[1].latest_step() == 4
