"""Restores from saved pieces (``pipeline/pieces.py``) on one process: every layout restores
bitwise (rows, columns, uneven, straddling two pieces; compressed, uncompressed and delta
blobs), memory stays within the in-flight budget whatever the state's size, damage found
before the first write leaves the live shards untouched, damage after it is reported with what
was written, and an uncompressed blob that changes between its two reads is caught.

The multi-rank paths (gloo ranks, DTensors, FSDP2, the DCP oracle) are in
``tests/distributed/test_reshard_dist.py``; these pin the streaming itself."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mithril_async.codec.container_read import parse_blob
from mithril_async.config import CompressionConfig, PipelineConfig
from mithril_async.errors import ChecksumMismatch, InvalidFormat, MissingPrevious
from mithril_async.manifest import BaseRef, PieceMeta, ShardRef
from mithril_async.pipeline.pool import CodecPool
from mithril_async.restore import execute as execute_mod
from mithril_async.restore.execute import ExecuteResources, Progress, open_item, write_item
from mithril_async.restore.fresh import FreshDecoder
from mithril_async.restore.plan import pieces_read
from mithril_async.restore.reshard import Box
from mithril_async.restore.targets import CopyRuns
from mithril_async.save.items import EncodePlan, StagedItem
from mithril_async.save.writers import BlobEncoder
from mithril_async.sharded import ShardTarget
from mithril_async.storage import LocalStore

PREFIX = "runs/x/versions/v000001"


@pytest.fixture
def pool() -> Iterator[CodecPool]:
    p = CodecPool(1)  # one codec thread: blocks go in order
    yield p
    p.shutdown()


def _codec(pool: Any, compressed: bool = True, chunk: float = 64 / 1024) -> BlobEncoder:
    return BlobEncoder(CompressionConfig(enabled=compressed, chunk_mib=chunk, auto_chunk=False),
                       PipelineConfig(), pool)


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


async def _save(codec: BlobEncoder, store: LocalStore, fulls: dict[str, torch.Tensor],
                boxes: list[Box], step: int = 1, prefix: str = PREFIX,
                plan: Any = None) -> dict[int, ShardRef]:
    """Rank ``r`` saves box ``boxes[r]`` of every tensor in ``fulls`` (one blob per rank)."""
    refs = {}
    skeleton = {"D": [[n, {"T": n}] for n in fulls]}
    for r, box in enumerate(boxes):
        sl = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
        part = {n: t[sl].contiguous() for n, t in fulls.items()}
        item = StagedItem("model", skeleton, part)
        ref = await codec.write(store, f"{prefix}/model_shard_rank{r}.bin", item, step=step,
                                plan=plan(r, part) if plan else None)
        refs[r] = ShardRef(rank=r, pieces={n: PieceMeta(
            global_shape=list(t.shape), offsets=list(box.offsets), lengths=list(box.lengths),
            dtype="float32") for n, t in fulls.items()}, **ref.model_dump())
    return refs


def _targets(fulls: dict[str, torch.Tensor], box: Box) -> dict[str, ShardTarget]:
    out = {}
    for n, t in fulls.items():
        local = torch.full(box.lengths, -7.0)
        out[n] = ShardTarget(local, local, box, tuple(t.shape), torch.float32)
    return out


def _slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


async def _no_bases(base: object, names: object) -> dict[str, torch.Tensor]:
    raise AssertionError("no delta blobs here")


async def _restore(codec: BlobEncoder, store: LocalStore, refs: dict[int, ShardRef],
                   targets: dict[str, ShardTarget], pool: Any, budget: int = 1 << 24,
                   verify: str = "block", load_blob: Any = _no_bases,
                   progress: Progress | None = None) -> Any:
    ctx = ExecuteResources(store, pool, FreshDecoder(pool), load_blob, budget)
    opened = await open_item(ctx, pieces_read("model", refs, targets), "v000001", 1, verify,
                             budget)
    await write_item(ctx, opened, progress or Progress(), budget)
    return opened


ROWS2 = [Box((0, 0), (48, 40)), Box((48, 0), (48, 40))]
ROWS3 = [Box((0, 0), (33, 40)), Box((33, 0), (33, 40)), Box((66, 0), (30, 40))]  # uneven
COLS2 = [Box((0, 0), (96, 20)), Box((0, 20), (96, 20))]
NEEDS = {
    "whole piece": Box((48, 0), (48, 40)),
    "half a piece": Box((12, 0), (24, 40)),
    "straddling two": Box((40, 0), (20, 40)),
    "columns": Box((0, 10), (96, 20)),
    "a corner": Box((30, 5), (40, 30)),
    "everything": Box((0, 0), (96, 40)),
}


@pytest.mark.parametrize("compressed", [True, False], ids=["mckp", "safetensors"])
@pytest.mark.parametrize("saved", [ROWS2, ROWS3, COLS2], ids=["rows/2", "rows/3", "cols/2"])
@pytest.mark.parametrize("need", list(NEEDS.values()), ids=list(NEEDS))
def test_every_layout_restores_bitwise(tmp_path: Path, pool: Any, compressed: bool,
                                       saved: list[Box], need: Box) -> None:
    fulls = {"a": _full((96, 40), 1), "b": _full((96, 40), 2)}
    codec = _codec(pool, compressed)
    store = LocalStore(tmp_path)

    async def run() -> Any:
        refs = await _save(codec, store, fulls, saved)
        targets = _targets(fulls, need)
        progress = Progress()
        opened = await _restore(codec, store, refs, targets, pool, progress=progress)
        return targets, opened, progress

    targets, opened, progress = asyncio.run(run())
    for n, t in fulls.items():
        assert torch.equal(targets[n].local, _slice(t, need)), n
    assert opened.skeleton == {"D": [["a", {"T": "a"}], ["b", {"T": "b"}]]}
    assert progress.items == {"model"}


def test_a_delta_blob_is_decoded_whole_and_copied(tmp_path: Path, pool: Any) -> None:
    """A piece stored as an XOR delta against an older blob (which the streaming path does
    not take) is decoded through its base and copied in."""
    fulls = {"a": _full((96, 40), 1)}
    older = {"a": fulls["a"] + 0.5}
    codec = _codec(pool)
    store = LocalStore(tmp_path)
    bases: dict[str, dict[str, torch.Tensor]] = {}

    async def run() -> torch.Tensor:
        base_refs = await _save(codec, store, older, ROWS2, prefix="runs/x/versions/v000000")
        for r, ref in base_refs.items():
            bases[ref.key] = {"a": _slice(older["a"], ROWS2[r]).contiguous()}

        def plan(r: int, part: dict[str, torch.Tensor]) -> EncodePlan:
            ref = base_refs[r]
            return EncodePlan(base=BaseRef(version_id="v000000", key=ref.key,
                                           xxh64=ref.xxh64),
                              base_views={"a": bases[ref.key]["a"].reshape(-1)
                                          .view(torch.uint8).numpy()})

        refs = await _save(codec, store, fulls, ROWS2, plan=plan)
        assert all(ref.base is not None for ref in refs.values())

        async def load_blob(base: BaseRef, names: object) -> dict[str, torch.Tensor]:
            return bases[base.key]

        need = NEEDS["straddling two"]
        targets = _targets(fulls, need)
        opened = await _restore(codec, store, refs, targets, pool, load_blob=load_blob)
        assert all(src.tensors is not None for src in opened.sources if src.what.runs)
        return targets["a"].local

    assert torch.equal(asyncio.run(run()), _slice(fulls["a"], NEEDS["straddling two"]))


@pytest.mark.parametrize("compressed", [True, False], ids=["mckp", "safetensors"])
def test_memory_stays_within_the_budget(tmp_path: Path, compressed: bool) -> None:
    """96 MiB of pieces, 48 MiB of them needed, restored with an 8 MiB budget: the restore
    allocates a few windows and a chunk per codec thread, not the pieces (it used to decode
    every needed piece into a buffer of its own first: the whole local state again)."""
    pool = CodecPool(2)
    fulls = {f"w{i}": _full((1024, 1024), i) for i in range(24)}  # 4 MiB each
    saved = [Box((0, 0), (512, 1024)), Box((512, 0), (512, 1024))]
    need = Box((256, 0), (512, 1024))  # half of each saved piece
    codec = _codec(pool, compressed, chunk=1.0)
    store = LocalStore(tmp_path)

    async def run() -> tuple[dict[str, ShardTarget], int]:
        refs = await _save(codec, store, fulls, saved)
        targets = _targets(fulls, need)
        tracemalloc.start()
        try:
            await _restore(codec, store, refs, targets, pool, budget=8 << 20)
            return targets, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    try:
        targets, peak = asyncio.run(run())
    finally:
        pool.shutdown()
    for n, t in fulls.items():
        assert torch.equal(targets[n].local, _slice(t, need)), n
    # (the live shards, 48 MiB, were allocated before tracing began)
    assert peak < 32 << 20, f"{peak / 2**20:.1f} MiB allocated by a restore of 48 MiB"


def _damage_block(path: Path, which: str) -> None:
    data = bytearray(path.read_bytes())
    blocks = sorted(parse_blob(bytes(data)).index.values(), key=lambda b: b.offset)
    b = blocks[0] if which == "first" else blocks[-1]
    data[b.offset + b.length - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damage_before_any_write_leaves_the_shards_untouched(tmp_path: Path, pool: Any) -> None:
    """A damaged index, a missing blob, a damaged block with verify="whole": all found
    before the first write, each its own error; the live shards keep their bytes."""
    fulls = {"a": _full((96, 40), 1), "b": _full((96, 40), 2)}
    codec = _codec(pool)
    store = LocalStore(tmp_path)
    refs = asyncio.run(_save(codec, store, fulls, ROWS2))
    need = NEEDS["straddling two"]
    blob1 = tmp_path / refs[1].key

    def attempt(**kw: Any) -> dict[str, ShardTarget]:
        targets = _targets(fulls, need)
        progress = Progress()
        kw.setdefault("progress", progress)
        with pytest.raises((ChecksumMismatch, InvalidFormat, MissingPrevious)) as err:
            asyncio.run(_restore(codec, store, refs, targets, pool, **kw))
        assert not progress.touched
        for t in targets.values():
            assert bool((t.local == -7.0).all())  # untouched
        return err.value  # type: ignore[return-value]

    good = blob1.read_bytes()
    _damage_block(blob1, "last")
    assert isinstance(attempt(verify="whole"), ChecksumMismatch)
    data = bytearray(good)
    data[-20] ^= 0xFF  # the trailer / index
    blob1.write_bytes(bytes(data))
    attempt()
    blob1.unlink()
    err = attempt()
    assert isinstance(err, MissingPrevious) and "rank 1" in str(err)


def test_damage_after_a_write_is_reported_with_what_was_written(tmp_path: Path,
                                                                pool: Any) -> None:
    """The last block of a blob damaged: with one codec thread the blocks before it are
    decoded into the live shards first; the error says so (progress names the blob and the
    item, for RestoreIncomplete and the fallback), the earlier bytes are the version's."""
    fulls = {"a": _full((960, 400), 1)}  # 12 chunks of 64 KiB per saved piece
    saved = [Box((0, 0), (480, 400)), Box((480, 0), (480, 400))]
    codec = _codec(pool)
    store = LocalStore(tmp_path)
    refs = asyncio.run(_save(codec, store, fulls, saved))
    _damage_block(tmp_path / refs[0].key, "last")
    need = saved[0]
    targets = _targets(fulls, need)
    progress = Progress()
    with pytest.raises(ChecksumMismatch, match="payload"):
        asyncio.run(_restore(codec, store, refs, targets, pool, progress=progress))
    assert progress.items == {"model"} and progress.written == [refs[0].key]
    local, want = targets["a"].local.reshape(-1), _slice(fulls["a"], need).reshape(-1)
    same = (local == want).numpy()
    assert same[:same.size // 2].all() and not same.all()  # the first chunks written


def test_an_uncompressed_blob_changed_between_its_reads_is_caught(
        tmp_path: Path, pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fulls = {"a": _full((96, 40), 1)}
    codec = _codec(pool, compressed=False)
    store = LocalStore(tmp_path)
    refs = asyncio.run(_save(codec, store, fulls, ROWS2))
    real = execute_mod.verify_blob

    async def then_changed(store_: Any, ref: Any, *a: Any) -> None:
        await real(store_, ref, *a)
        path = tmp_path / ref.key
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))

    monkeypatch.setattr(execute_mod, "verify_blob", then_changed)
    progress = Progress()
    with pytest.raises(ChecksumMismatch, match="changed while it was restored"):
        asyncio.run(_restore(codec, store, refs, _targets(fulls, ROWS2[1]), pool,
                             progress=progress))
    assert progress.items == {"model"}


def test_a_piece_of_another_shape_than_its_manifest_entry_is_refused(tmp_path: Path,
                                                                    pool: Any) -> None:
    fulls = {"a": _full((96, 40), 1)}
    codec = _codec(pool)
    store = LocalStore(tmp_path)
    refs = asyncio.run(_save(codec, store, fulls, ROWS2))
    # rank 1's entry claims rows [24, 96): it alone covers the rows [48, 96) needed
    refs[1] = refs[1].model_copy(update={"pieces": {"a": refs[1].pieces["a"].model_copy(
        update={"lengths": [72, 40], "offsets": [24, 0]})}})
    targets = _targets(fulls, ROWS2[1])
    with pytest.raises(InvalidFormat, match=r"rank 1's tensor 'a' is float32\[48, 40\], "
                                            r"its manifest entry says float32\[72, 40\]"):
        asyncio.run(_restore(codec, store, refs, targets, pool))
    assert bool((targets["a"].local == -7.0).all())


def test_runs_copy_only_what_lies_in_a_segment() -> None:
    """``_Runs.copy_from`` with runs that start before, inside and after a segment, and
    ``inside_one`` for chunks inside one run and across two."""
    live = torch.zeros(64, dtype=torch.uint8)
    runs = np.array([[0, 0, 10], [20, 10, 10], [40, 20, 10]], dtype=np.int64)
    r = CopyRuns.of(runs, live)
    data = np.arange(100, 130, dtype=np.uint8)  # piece bytes [15, 45)
    r.copy_from(15, data)
    got = live.numpy()
    assert got[:10].tolist() == [0] * 10  # run 0 ends at 10 < 15
    assert got[10:20].tolist() == list(range(105, 115))  # run 1: piece [20, 30)
    assert got[20:25].tolist() == list(range(125, 130))  # run 2: piece [40, 45)
    assert got[25:30].tolist() == [0] * 5
    inside = r.inside_one(22, 8)
    assert inside is not None and inside.size == 8
    assert r.inside_one(5, 10) is None  # crosses out of run 0
    assert r.inside_one(12, 4) is None  # in a gap
