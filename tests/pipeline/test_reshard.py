"""The pure reshard math (pipeline/reshard.py) against numpy slicing, on random shapes and
random (uneven, empty-piece) partitions at save and at restore."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mithril_async.errors import InvalidFormat, MissingPrevious
from mithril_async.restore.reshard import Box, SavedPiece, copy_runs, plan_reads


def _cuts(draw: st.DrawFn, size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges tiling ``[0, size)`` (some may be empty)."""
    points = sorted(draw(st.lists(st.integers(0, size), min_size=parts - 1,
                                  max_size=parts - 1)))
    edges = [0, *points, size]
    return [(edges[i], edges[i + 1] - edges[i]) for i in range(parts)]


@st.composite
def grids(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A random grid partition of ``shape``: each dim cut into 1-3 ranges."""
    per_dim = [_cuts(draw, s, draw(st.integers(1, 3))) for s in shape]
    boxes = [Box((), ())]
    for cuts in per_dim:
        boxes = [Box((*b.offsets, o), (*b.lengths, n)) for b in boxes for o, n in cuts]
    return boxes


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], list[Box], int]:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    return (shape, draw(grids(shape)), draw(grids(shape)),
            draw(st.sampled_from([1, 2, 4, 8])))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_reads_and_runs_rebuild_every_needed_piece(case: tuple[tuple[int, ...], list[Box],
                                                                 list[Box], int]) -> None:
    shape, saved_boxes, need_boxes, itemsize = case
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    full = np.arange(math.prod(shape), dtype=dtype).reshape(shape) * 3 + 1
    # every saved piece once, plus a replica of each on a higher rank (a Replicate mesh dim)
    pieces = [SavedPiece(r, b) for r, b in enumerate(saved_boxes)]
    pieces += [SavedPiece(r + len(saved_boxes), b, True) for r, b in enumerate(saved_boxes)]
    stored = {p.rank: np.ascontiguousarray(full[_slices(p.box)]).reshape(-1).view(np.uint8)
              for p in pieces}
    for need in need_boxes:
        reads = plan_reads("t", need, pieces)
        assert all(r.rank < len(saved_boxes) for r in reads), "a replica is read from the lowest"
        out = np.zeros(need.lengths, dtype=dtype)
        raw = out.reshape(-1).view(np.uint8)
        total = 0
        for r in reads:
            runs = copy_runs(r.src, need, r.overlap, itemsize)
            assert (np.diff(runs[:, 0]) > 0).all() if len(runs) > 1 else True
            for s, d, n in runs.tolist():
                raw[d:d + n] = stored[r.rank][s:s + n]
                total += n
        assert total == need.numel * itemsize  # every byte once
        assert np.array_equal(out, full[_slices(need)])


def test_whole_rows_merge_into_one_run() -> None:
    src, dst = Box((0, 0), (6, 8)), Box((3, 0), (3, 8))
    runs = copy_runs(src, dst, src.intersect(dst) or dst, 4)
    assert runs.tolist() == [[3 * 8 * 4, 0, 3 * 8 * 4]]
    cols = copy_runs(Box((0, 0), (4, 8)), Box((0, 4), (4, 4)), Box((0, 4), (4, 4)), 2)
    assert cols.tolist() == [[16 * r + 8, 8 * r, 8] for r in range(4)]


def test_a_hole_is_missing_previous_naming_the_tensor() -> None:
    pieces = [SavedPiece(0, Box((0,), (3,))), SavedPiece(2, Box((6,), (4,)))]
    with pytest.raises(MissingPrevious, match=r"'w'.*7 of the 10.*\[0:10\]"):
        plan_reads("w", Box((0,), (10,)), pieces)


def test_overlapping_saved_pieces_are_invalid() -> None:
    pieces = [SavedPiece(0, Box((0,), (6,))), SavedPiece(1, Box((4,), (6,)))]
    with pytest.raises(InvalidFormat, match="overlap"):
        plan_reads("w", Box((0,), (10,)), pieces)


def test_scalar_and_empty() -> None:
    reads = plan_reads("step", Box((), ()), [SavedPiece(1, Box((), ()), True),
                                             SavedPiece(0, Box((), ()), True)])
    assert [r.rank for r in reads] == [0]
    assert copy_runs(Box((), ()), Box((), ()), Box((), ()), 4).tolist() == [[0, 0, 4]]
    assert plan_reads("e", Box((0,), (0,)), [SavedPiece(0, Box((0,), (5,)))]) == []


def test_shard_metadata_names_match_the_stored_tensor_names() -> None:
    """The manifest's pieces are keyed by the names flatten_state stores tensors under."""
    import torch

    from mithril_async.sharded import state_leaves
    from mithril_async.state import flatten_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    trees = [model.state_dict(), opt.state_dict(),
             {"a": [torch.zeros(1), (torch.ones(2), {"b": torch.ones(())})], 1: torch.zeros(3),
              "1": torch.zeros(2), "x": np.zeros(2)}, torch.zeros(2), [torch.zeros(1)]]
    for tree in trees:
        assert [n for n, _ in state_leaves(tree)] == list(flatten_state(tree)[1])


def test_piece_metadata_is_validated_and_optional() -> None:
    from mithril_async.manifest import BlobRef, PieceMeta, ShardRef

    with pytest.raises(ValueError, match="exceeds the global size"):
        PieceMeta(global_shape=[6], offsets=[5], lengths=[3], dtype="float32")
    with pytest.raises(ValueError, match="2 offsets"):
        PieceMeta(global_shape=[6], offsets=[0, 0], lengths=[6], dtype="float32")
    with pytest.raises(ValueError):
        PieceMeta(global_shape=[6], offsets=[-1], lengths=[6], dtype="float32")
    old = {"key": "runs/r/v/a.bin", "bytes": 1, "xxh64": "0" * 16, "rank": 1}
    ref = ShardRef.model_validate(old)  # a manifest entry written before issue 25
    assert ref.pieces == {} and "pieces" not in ref.model_dump(mode="json")
    piece = PieceMeta(global_shape=[6, 2], offsets=[3, 0], lengths=[3, 2], dtype="bfloat16")
    new = ShardRef(rank=1, key="runs/r/v/a.bin", bytes=1, xxh64="0" * 16, pieces={"w": piece})
    assert ShardRef.model_validate_json(new.model_dump_json()) == new
    assert "replicated" not in new.model_dump(mode="json")["pieces"]["w"]  # only when true
    assert BlobRef.model_validate({k: v for k, v in old.items() if k != "rank"}).pieces == {}


def test_default_on_reshard_maps_distributed_sampler_positions() -> None:
    from mithril_async.state import default_on_reshard

    saved = {0: {"position": 10, "epoch": 3, "exact": True},
             1: {"position": 12, "epoch": 3, "exact": True}}
    assert default_on_reshard(saved, 0, 4) == {"position": 5, "epoch": 3, "exact": False}
    assert default_on_reshard(saved, 3, 4)["epoch"] == 3  # rank 0's state for a new rank
    assert default_on_reshard(saved, 1, 1)["position"] == 22
    assert default_on_reshard({0: {"name": "x"}}, 2, 3) == {"name": "x", "exact": False}


def test_reseeding_is_deterministic_and_per_rank() -> None:
    import torch

    from mithril_async.state import capture_rng, reseed_rng

    saved = capture_rng()
    draws = []
    for rank in (2, 3, 2):
        reseed_rng(saved, rank)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


class _Counting:
    """A MemoryStore that counts the bytes its ranged and whole reads return."""

    def __init__(self) -> None:
        from mithril_async.storage.memory import MemoryStore

        self.inner = MemoryStore()
        self.read = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        data = await self.inner.get_range(key, start, length)
        self.read += len(data)
        return data

    async def get(self, key: str) -> bytes:
        data = await self.inner.get(key)
        self.read += len(data)
        return data


def test_pieces_are_read_by_the_chunks_a_rank_needs() -> None:
    """A 2 -> 4 reshard of a row-sharded [256, 64] fp32 tensor: the new rank holding rows
    [64, 128) reads the chunks covering them in saved rank 0's blob (about half of it), and
    nothing of rank 1's."""
    import asyncio

    import torch

    from mithril_async.config import CompressionConfig, PipelineConfig
    from mithril_async.manifest import PieceMeta, ShardRef
    from mithril_async.pipeline.pool import CodecPool
    from mithril_async.restore.execute import ExecuteResources, Progress, open_item, write_item
    from mithril_async.restore.fresh import FreshDecoder
    from mithril_async.restore.plan import pieces_read
    from mithril_async.save.items import StagedItem
    from mithril_async.save.writers import BlobEncoder
    from mithril_async.sharded import ShardTarget

    full = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    pool = CodecPool(2)
    codec = BlobEncoder(CompressionConfig(chunk_mib=1024 / 2**20), PipelineConfig(), pool)
    store = _Counting()

    async def run() -> torch.Tensor:
        refs = {}
        for r in range(2):
            rows = full[128 * r:128 * (r + 1)].clone()
            item = StagedItem("model", {"D": [["w", {"T": "w"}]]}, {"w": rows})
            ref = await codec.write(store, f"runs/x/v/model_shard_rank{r}.bin", item, step=1)
            refs[r] = ShardRef(rank=r, pieces={"w": PieceMeta(
                global_shape=[256, 64], offsets=[128 * r, 0], lengths=[128, 64],
                dtype="float32")}, **ref.model_dump())
        store.read = 0
        local = torch.zeros(64, 64)
        target = ShardTarget(local, local, Box((64, 0), (64, 64)), (256, 64), torch.float32)
        async def no_bases(base: object, names: object) -> dict[str, torch.Tensor]:
            raise AssertionError("these blobs are no deltas")

        ctx = ExecuteResources(store, pool, FreshDecoder(pool),
                               no_bases, 1 << 24)  # type: ignore[arg-type]
        opened = await open_item(ctx, pieces_read("model", refs, {"w": target}), "v000001", 1,
                                 "block", 1 << 24)
        assert local.abs().sum() == 0  # nothing written before write_item
        progress = Progress()
        await write_item(ctx, opened, progress, 1 << 24)
        assert opened.skeleton == {"D": [["w", {"T": "w"}]]}
        assert progress.items == {"model"}
        assert progress.written == ["runs/x/v/model_shard_rank0.bin"]
        return local

    try:
        local = asyncio.run(run())
    finally:
        pool.shutdown()
    assert torch.equal(local, full[64:128])
    blob0 = asyncio.run(store.inner.size("runs/x/v/model_shard_rank0.bin"))
    # 16 of the 32 KiB of rows, from 1 KiB chunks, plus trailer, header and index
    assert blob0 * 0.45 < store.read < blob0 * 0.6, (store.read, blob0)
