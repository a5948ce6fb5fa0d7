"""One-pass restores (``verify = "block"``, the default): each MCKP blob is read once, every
block verified before a byte of it reaches a live tensor, the blob's whole hash checked at its
end. Damage found after the first write is ``RestoreIncomplete`` (partially overwritten, naming
what was written); ``fallback=True`` then restores an older version over all of it.

Which blocks are decoded before the damaged one is read is fixed by gates in the store (each
block its own window), not by timing."""

from __future__ import annotations

import asyncio
import copy
import errno
import itertools
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import mithril_async.restore.block_decode as stream
import mithril_async.restore.execute as execute
import mithril_async.restore.targets as targets
import mithril_async.restore.windows as windows
from mithril_async import CheckpointManager, ChecksumMismatch, Config, ConfigError, parse_config
from mithril_async.codec.container import BlockRef
from mithril_async.codec.container_read import parse_blob
from mithril_async.errors import (
    InvalidFormat,
    RestoreIncomplete,
    ShapeMismatch,
    StorageError,
    VersionNotFound,
)
from mithril_async.storage import local_reads
from mithril_async.storage.local import LocalStore
from tests.manager.conftest import Batcher, TinyNet, state_equal, train_step

EXTRA = "[checkpointing.compression]\nthreads = 2\nchunk_mib = 0.01\n"
VDIR = Path("runs") / "run1" / "versions"


class GatedStore(LocalStore):
    """A local store whose ranged reads go through ``get_range`` (overriding it turns the
    range reader off) and can be held back: ``gates[(key, offset)]`` is awaited before the
    read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gates: dict[tuple[str, int], Callable[[], Awaitable[None]]] = {}
        self.whole_gets: list[str] = []

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        gate = self.gates.get((key, start))
        if gate is not None:
            await gate()
        return await super().get_range(key, start, length)

    async def get(self, key: str) -> bytes:
        self.whole_gets.append(key)
        return await super().get(key)


class GatedReaderStore(LocalStore):
    """A local store read through its range reader (each window read and decoded by one
    codec-pool task), whose window reads can be held back on the pool thread:
    ``thread_gates[(key, offset)]()`` is called before the read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.thread_gates: dict[tuple[str, int], Callable[[], None]] = {}
        self.whole_gets: list[str] = []
        self.readers: list[str] = []

    async def open_range_reader(self, key: str) -> Any:
        self.readers.append(key)
        opened = await super().open_range_reader(key)
        assert opened is not None  # get_range is LocalStore's own
        inner = opened
        gates = self.thread_gates

        class Gated:
            def read(self, start: int, length: int) -> bytes:
                gate = gates.get((key, start))
                if gate is not None:
                    gate()
                return inner.read(start, length)

            def close(self) -> None:
                inner.close()

        return Gated()

    async def get(self, key: str) -> bytes:
        self.whole_gets.append(key)
        return await super().get(key)


@pytest.fixture(params=["get_range", "reader"])
def gated(request: pytest.FixtureRequest, tmp_path: Path) -> GatedStore | GatedReaderStore:
    """Both ways a local blob is read: window by window through ``get_range`` (a thread
    hop for the read, one pool task per block), or through the store's range reader (one
    pool task reads and decodes a window)."""
    if request.param == "get_range":
        return GatedStore(tmp_path)
    return GatedReaderStore(tmp_path)


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes read by ranged reads of local files, per file path (both read paths)."""
    got: dict[str, int] = {}
    real = local_reads.pread

    def counting(fs: ModuleType, fd: int, start: int, length: int) -> bytes:
        data = real(fs, fd, start, length)
        path = os.readlink(f"/proc/self/fd/{fd}")
        got[path] = got.get(path, 0) + len(data)
        return data

    monkeypatch.setattr(local_reads, "pread", counting)
    return got


def _state(optimizer: bool = True) -> tuple[TinyNet, Any, dict[str, Any]]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, Batcher())
    state: dict[str, Any] = {"model": model}
    if optimizer:
        state["optimizer"] = opt
    return model, opt, state


def _snap(model: torch.nn.Module, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _model_blob(tmp_path: Path, version: int) -> tuple[str, Path]:
    (path,) = (tmp_path / VDIR / f"v{version:06d}").glob("model*.mckp")
    return str(path.relative_to(tmp_path)), path


def _damage(path: Path, which: str) -> tuple[BlockRef, Any]:
    """Flip the last payload byte of the first or last block (by offset) of a blob."""
    data = bytearray(path.read_bytes())
    info = parse_blob(bytes(data))
    blocks = sorted(info.index.values(), key=lambda b: b.offset)
    assert len(blocks) >= 4  # several blocks, so some are written before the damaged one
    b = blocks[0] if which == "first" else blocks[-1]
    data[b.offset + b.length - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    return b, info


def _hold_until_others_decoded(store: GatedStore | GatedReaderStore, key: str, b: BlockRef,
                               info: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The damaged block ``b`` is read only after every other block of blob ``key`` has been
    decoded into the live tensors (each block is its own window: ``WINDOW`` = 1 byte)."""
    monkeypatch.setattr(windows, "WINDOW", 1)
    decoded = [0]
    real = stream.decode_chunk

    def counting(*a: Any, where: str = "", **k: Any) -> Any:
        out = real(*a, where=where, **k)
        if where.startswith(f"{key}: "):
            decoded[0] += 1
        return out

    monkeypatch.setattr(stream, "decode_chunk", counting)
    others = len(info.index) - 1

    async def gate() -> None:
        while decoded[0] < others:  # polled: decodes finish on the codec threads
            await asyncio.sleep(0.002)

    def thread_gate() -> None:  # on a codec thread: the other one decodes the rest
        deadline = time.monotonic() + 120
        while decoded[0] < others:
            assert time.monotonic() < deadline, "the other blocks were never decoded"
            time.sleep(0.002)

    if isinstance(store, GatedStore):
        store.gates[(key, b.offset)] = gate
    else:
        store.thread_gates[(key, b.offset)] = thread_gate


def _manager(make_config: Callable[..., Config], tmp_path: Path, state: dict[str, Any],
             store: LocalStore | None = None) -> CheckpointManager:
    return CheckpointManager(make_config(EXTRA), state, store=store or LocalStore(tmp_path),
                             runs_prefix="runs")


def test_block_mode_reads_each_blob_once_into_the_live_tensors(
        tmp_path: Path, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch,
        gated: GatedStore | GatedReaderStore, bytes_read: dict[str, int]) -> None:
    model, opt, state = _state()
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
    saved = _snap(model, opt)
    train_step(model, opt, Batcher())  # the live state moves on
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}

    def no_whole_pass(*a: object, **k: object) -> None:
        raise AssertionError("an MCKP blob was verified in a separate pass")

    monkeypatch.setattr(execute, "verify_blob", no_whole_pass)
    store = gated
    bytes_read.clear()
    with _manager(make_config, tmp_path, state, store) as mgr:
        assert mgr.restore_sync("latest") == 1
    assert state_equal(saved[0], model.state_dict())
    assert state_equal(saved[1], opt.state_dict())
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == ptrs
    blobs = {str(p.relative_to(tmp_path)): p.stat().st_size
             for p in (tmp_path / VDIR / "v000001").iterdir() if p.suffix in (".mckp", ".bin")}
    assert len(blobs) == 2 and not set(blobs) & set(store.whole_gets)
    got = {k: bytes_read.get(str(tmp_path / k)) for k in blobs}
    assert got == blobs  # every byte read exactly once
    if isinstance(store, GatedReaderStore):  # the blocks came through the range readers
        assert sorted(store.readers) == sorted(blobs)


def test_a_damaged_block_after_others_were_written_is_restore_incomplete(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch,
        gated: GatedStore | GatedReaderStore) -> None:
    model, opt, state = _state(optimizer=False)
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
    saved = copy.deepcopy(model.state_dict())
    train_step(model, opt, Batcher())
    before = copy.deepcopy(model.state_dict())
    key, path = _model_blob(tmp_path, 1)
    b, info = _damage(path, "last")
    store = gated
    _hold_until_others_decoded(store, key, b, info, monkeypatch)
    with (_manager(make_config, tmp_path, state, store) as mgr,
          pytest.raises(RestoreIncomplete, match="partially overwritten") as err):
        mgr.restore_sync("latest")
    assert key in str(err.value) and err.value.partially_overwritten
    assert isinstance(err.value.__cause__, ChecksumMismatch)
    assert "payload" in str(err.value.__cause__)
    # really mixed: every other block holds the version's bytes, the damaged one the old
    damaged = info.tensors[b.tensor].name
    off, ln = info.tensors[b.tensor].chunks[b.chunk]
    now = model.state_dict()
    for name in now:
        if name != damaged:
            assert torch.equal(now[name], saved[name]), name

    def chunk(t: torch.Tensor) -> bytes:
        return t.reshape(-1).view(torch.uint8)[off:off + ln].numpy().tobytes()

    assert chunk(now[damaged]) == chunk(before[damaged]) != chunk(saved[damaged])


def test_a_damaged_first_block_with_nothing_written_is_its_own_error(
        tmp_path: Path, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch,
        gated: GatedStore | GatedReaderStore) -> None:
    model, opt, state = _state(optimizer=False)
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
    train_step(model, opt, Batcher())
    before = copy.deepcopy(model.state_dict())
    key, path = _model_blob(tmp_path, 1)
    b, info = _damage(path, "first")
    monkeypatch.setattr(windows, "WINDOW", 1)
    store = gated
    never = asyncio.Event()

    async def held() -> None:  # cancelled once the damaged block fails
        await never.wait()

    failed = threading.Event()
    real = stream.settled

    async def watched(pool: Any, calls: Any) -> None:
        try:
            await real(pool, calls)
        except ChecksumMismatch:  # on the loop: the damaged window's task is done now
            failed.set()
            raise

    def held_then_refused() -> None:  # a read on a codec thread cannot be cancelled: it
        assert failed.wait(120)  # waits until the damage is reported, then fails unwritten
        raise StorageError(errno.EIO, "held back by the test")

    monkeypatch.setattr(stream, "settled", watched)
    for other in info.index.values():
        if other.offset != b.offset:
            if isinstance(store, GatedStore):
                store.gates[(key, other.offset)] = held
            else:
                store.thread_gates[(key, other.offset)] = held_then_refused
    with _manager(make_config, tmp_path, state, store) as mgr:
        with pytest.raises(ChecksumMismatch, match="payload"):
            mgr.restore_sync("latest")
        failed.clear()
        with pytest.raises(VersionNotFound, match="no version at or before v000001"):
            mgr.restore_sync("latest", fallback=True)
    assert state_equal(before, model.state_dict())  # untouched


def test_fallback_after_a_partial_overwrite_restores_the_older_version_whole(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch,
        gated: GatedStore | GatedReaderStore) -> None:
    model, opt, state = _state()
    batcher = Batcher()
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
        v1 = _snap(model, opt)
        train_step(model, opt, batcher)
        mgr.save_nowait(2).result()
    train_step(model, opt, batcher)
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    key, path = _model_blob(tmp_path, 2)
    b, info = _damage(path, "last")
    store = gated
    _hold_until_others_decoded(store, key, b, info, monkeypatch)
    with _manager(make_config, tmp_path, state, store) as mgr:
        res = mgr.restore_sync("latest", fallback=True)
    assert res == 1
    assert state_equal(v1[0], model.state_dict())  # bitwise the older version, all of it
    assert state_equal(v1[1], opt.state_dict())
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == ptrs


def test_range_readers_are_closed_after_every_restore(
        tmp_path: Path, make_config: Callable[..., Config]) -> None:
    """Each restore opens one file per blob for its window reads (plain local store, both
    verify modes, compressed and raw blobs) and closes it, also when a damaged block fails
    the restore."""
    _model, _opt, state = _state()
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
    with CheckpointManager(make_config("[checkpointing.compression]\nenabled = false\n"),
                           state, store=LocalStore(tmp_path), runs_prefix="raw") as mgr:
        mgr.save_nowait(1).result()

    def fds() -> list[str]:
        """The files of the runs this process holds open (other tests' objects may close
        theirs at any time: only these count)."""
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if path.startswith(str(tmp_path)) and path.endswith((".mckp", ".bin", ".safetensors")):
                out.append(path)
        return sorted(out)

    with _manager(make_config, tmp_path, state) as mgr:
        before = fds()
        assert before == []
        for verify in ("block", "whole"):
            assert mgr.restore_sync("latest", verify=verify) == 1
        assert fds() == before
        _damage(_model_blob(tmp_path, 1)[1], "last")
        with pytest.raises((ChecksumMismatch, RestoreIncomplete)):
            mgr.restore_sync("latest")
        assert fds() == before
    with CheckpointManager(make_config(""), state, store=LocalStore(tmp_path),
                           runs_prefix="raw") as mgr:
        assert mgr.restore_sync("latest") == 1
        assert fds() == []


def test_a_blob_of_another_version_in_its_place_is_caught_before_writing(
        tmp_path: Path, make_config: Callable[..., Config]) -> None:
    """v2's model blob copied over v1's, the manifest's size edited to match (a manifest
    carries no checksum): every piece of the blob is self-consistent, but its header records
    step 2, so block mode refuses it before writing (the manifest's whole-blob hash, which
    block mode does not recompute, is what whole mode catches it by)."""
    model, opt, state = _state(optimizer=False)
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
        train_step(model, opt, Batcher())
        mgr.save_nowait(2).result()
    train_step(model, opt, Batcher())
    before = copy.deepcopy(model.state_dict())
    _, v1 = _model_blob(tmp_path, 1)
    _, v2 = _model_blob(tmp_path, 2)
    v1.write_bytes(v2.read_bytes())
    mpath = tmp_path / VDIR / "v000001" / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["model"]["bytes"] = v2.stat().st_size
    mpath.write_text(json.dumps(doc))
    with _manager(make_config, tmp_path, state) as mgr:
        with pytest.raises(InvalidFormat, match="header says step 2, the manifest's is 1"):
            mgr.restore_sync(1)
        assert state_equal(before, model.state_dict())
        with pytest.raises(ChecksumMismatch):
            mgr.restore_sync(1, verify="whole")
        assert state_equal(before, model.state_dict())


def test_uncompressed_blobs_are_still_verified_whole_before_writing(
        tmp_path: Path, make_config: Callable[..., Config]) -> None:
    """A safetensors blob has one whole-file hash and no per-block ones: in block mode too it
    is verified whole before its first write, so damage leaves the state untouched."""
    model, opt, state = _state()
    extra = "[checkpointing.compression]\nenabled = false\n"
    with CheckpointManager(make_config(extra), state) as mgr:
        mgr.save_nowait(1).result()
    train_step(model, opt, Batcher())
    before = _snap(model, opt)
    (path,) = (tmp_path / VDIR / "v000001").glob("model*.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with CheckpointManager(make_config(extra), state) as mgr, pytest.raises(ChecksumMismatch):
        mgr.restore_sync("latest", verify="block")
    assert state_equal(before[0], model.state_dict())
    assert state_equal(before[1], opt.state_dict())


def test_the_verify_mode_is_validated_and_chosen_by_the_config(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole = []
    real = execute.verify_blob

    async def counting(store: Any, ref: Any, *a: Any) -> None:
        whole.append(ref.key)
        await real(store, ref, *a)

    monkeypatch.setattr(execute, "verify_blob", counting)
    with pytest.raises(ConfigError, match=r"checkpointing\.restore\.verify"):
        parse_config('[checkpointing]\n[checkpointing.restore]\nverify = "blocks"\n')
    assert parse_config("[checkpointing]\n").checkpointing.restore.verify == "block"
    cfg = make_config(EXTRA + '[checkpointing.restore]\nverify = "whole"\n')
    assert cfg.checkpointing.restore.verify == "whole"
    _model, _opt, state = _state()
    with CheckpointManager(cfg, state) as mgr:
        mgr.save_nowait(1).result()
        with pytest.raises(ConfigError, match="'everything'"):
            mgr.restore_sync("latest", verify="everything")  # type: ignore[arg-type]
        assert mgr.restore_sync("latest") == 1  # the config's "whole": two passes
        assert len(whole) == 2
        assert mgr.restore_sync("latest", verify="block") == 1  # the argument wins
        assert len(whole) == 2


def test_no_fallback_to_a_version_that_cannot_write_over_all_that_was_touched(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch,
        gated: GatedStore | GatedReaderStore) -> None:
    """v1 holds the model only; v2's optimizer blob is damaged after some of its blocks were
    written: falling back to v1 would leave those moments half-written, so the restore says
    so (RestoreIncomplete naming the item) instead of returning."""
    model, opt, state = _state()
    with _manager(make_config, tmp_path, {"model": model}) as mgr:
        mgr.save_nowait(1).result()
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(2).result()
    train_step(model, opt, Batcher())
    (path,) = (tmp_path / VDIR / "v000002").glob("opt*.bin")
    key = str(path.relative_to(tmp_path))
    b, info = _damage(path, "last")
    store = gated
    _hold_until_others_decoded(store, key, b, info, monkeypatch)
    with (_manager(make_config, tmp_path, state, store) as mgr,
          pytest.raises(RestoreIncomplete, match="v000001 has no optimizer") as err):
        mgr.restore_sync("latest", fallback=True)
    assert "partially overwritten" in str(err.value)
    assert isinstance(err.value.__cause__, RestoreIncomplete)


def test_any_error_of_the_fallback_after_a_partial_overwrite_is_restore_incomplete(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch,
        gated: GatedStore | GatedReaderStore) -> None:
    """v1 was saved by a model of other shapes; v2's model blob is damaged after some of
    its blocks were written: the fallback to v1 fails with a ShapeMismatch (not a damage
    error), and the live state is partially overwritten, so that is RestoreIncomplete too,
    never the bare error of the older version."""
    torch.manual_seed(0)
    small = TinyNet(d=16)
    with _manager(make_config, tmp_path, {"model": small}) as mgr:
        mgr.save_nowait(1).result()
    model, opt, state = _state(optimizer=False)
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(2).result()
    train_step(model, opt, Batcher())
    key, path = _model_blob(tmp_path, 2)
    b, info = _damage(path, "last")
    _hold_until_others_decoded(gated, key, b, info, monkeypatch)
    with (_manager(make_config, tmp_path, state, gated) as mgr,
          pytest.raises(RestoreIncomplete, match="partially overwritten") as err):
        mgr.restore_sync("latest", fallback=True)
    assert isinstance(err.value.__cause__, ShapeMismatch)
    assert "v000001" in str(err.value)


def test_window_plan_fits_the_budget_locally_and_over_a_network() -> None:
    mib = 1 << 20
    assert windows.window_plan(128 * mib, 2) == (4 * mib, 4)  # codec threads busy
    assert windows.window_plan(8 * mib, 16) == (4 * mib, 2)  # the budget bounds it
    # remote: larger reads, as many as the store's requests, within the budget
    assert windows.window_plan(128 * mib, 2, remote=8) == (8 * mib, 8)
    assert windows.window_plan(32 * mib, 2, remote=8) == (8 * mib, 4)
    assert windows.window_plan(8 * mib, 2, remote=8) == (4 * mib, 2)
    for budget in (16 * mib, 40 * mib, 256 * mib):
        window, depth = windows.window_plan(budget, 2, remote=8)
        assert window * depth <= budget


def test_a_live_tensor_of_another_dtype_is_restored_in_place_through_the_ring(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 saved, fp64 live: each block is decoded into a leased chunk buffer and converted
    into its span of the live tensor (no fresh tensor of the whole, no load_state_dict
    copy); the ring never holds more buffers than it has."""
    model, _opt, state = _state(optimizer=False)
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
    saved = copy.deepcopy(model.state_dict())
    live = TinyNet().double()
    ptrs = {n: t.data_ptr() for n, t in live.state_dict().items()}
    rings: list[targets.StagingRing] = []

    class Watched(targets.StagingRing):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            rings.append(self)

    monkeypatch.setattr(stream, "StagingRing", Watched)
    with _manager(make_config, tmp_path, {"model": live}) as mgr:
        got = mgr._bg(mgr.restorer.read("latest", False, "all"))
        assert got.in_place == {"model"}
        mgr.restorer.apply(got, "all")
    now = live.state_dict()
    assert {n: t.data_ptr() for n, t in now.items()} == ptrs
    assert all(now[n].dtype == torch.float64 and torch.equal(now[n], saved[n].double())
               for n in saved)
    (ring,) = rings
    nblocks = sum(len(t.chunks) for t in ring.info.tensors)
    assert nblocks > len(ring.ring.buffers) >= ring.peak >= 1  # reused, within its slots
    assert ring.ring.free == len(ring.ring.buffers)  # every buffer given back


def test_the_ring_copies_every_element_once_through_the_devices_copier(
        tmp_path: Path, make_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copier comes from ``copier_for(device)`` (CUDA: non_blocking on a side stream);
    with a recording stand-in, every element of every staged tensor is copied exactly once
    (chunk spans: no gap, no overlap)."""
    model, _opt, state = _state(optimizer=False)
    with _manager(make_config, tmp_path, state) as mgr:
        mgr.save_nowait(1).result()
    saved = copy.deepcopy(model.state_dict())
    live = TinyNet().double()
    spans: dict[int, list[tuple[int, int]]] = {}
    devices: list[torch.device] = []

    class Recording(targets.HostCopier):
        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            base = dst.untyped_storage().data_ptr()
            first = (dst.data_ptr() - base) // dst.element_size()
            spans.setdefault(base, []).append((first, first + dst.numel()))
            super().copy(dst, src)

    def copier_for(device: torch.device) -> targets.HostCopier:
        devices.append(device)
        return Recording()

    monkeypatch.setattr(targets, "copier_for", copier_for)
    with _manager(make_config, tmp_path, {"model": live}) as mgr:
        assert mgr.restore_sync("latest") == 1
    assert devices == [torch.device("cpu")]  # one copier per device of the blob's targets
    now = live.state_dict()
    assert all(torch.equal(now[n], saved[n].double()) for n in saved)
    for t in now.values():
        got = sorted(spans[t.untyped_storage().data_ptr()])
        assert got[0][0] == 0 and got[-1][1] == t.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


def test_stageable_targets() -> None:
    t = torch.zeros(4, 6, dtype=torch.float64)
    assert targets.stageable(t, "float32", (4, 6))
    assert not targets.stageable(t.t(), "float32", (6, 4))  # not contiguous: fresh tensor
    assert not targets.stageable(t, "float32", (6, 4))  # another shape
    assert not targets.stageable(torch.zeros(0), "float32", (0,))
