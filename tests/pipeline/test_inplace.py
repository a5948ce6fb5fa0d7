"""Restores decode straight into the live tensors (mithril_async/restore/), block by block, each
block verified before it is written; a failure says whether the live state was touched."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, ChecksumMismatch, Config
from mithril_async.codec.container_read import parse_blob
from mithril_async.errors import RestoreIncomplete
from mithril_async.restore.windows import group_windows
from mithril_async.storage.local import LocalStore
from tests.manager.conftest import TinyNet, state_equal, train_step

EXTRA = "[checkpointing.compression]\nthreads = 2\nchunk_mib = 0.01\n"


def _trained(make_config: Callable[..., Config]) -> tuple[TinyNet, Any, CheckpointManager,
                                                          dict[str, Any]]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from tests.manager.conftest import Batcher

    batcher = Batcher()
    for _ in range(2):
        train_step(model, opt, batcher)
    mgr = CheckpointManager(make_config(EXTRA), {"model": model, "optimizer": opt})
    mgr.save_nowait(1).result()
    saved = {"model": copy.deepcopy(model.state_dict()),
             "opt": copy.deepcopy(opt.state_dict())}
    train_step(model, opt, batcher)  # the live state moves on
    return model, opt, mgr, saved


def _blob(tmp_path: Path, what: str) -> Path:
    (path,) = (tmp_path / "runs" / "run1" / "versions" / "v000001").glob(f"{what}*.mckp")
    return path


def test_restore_writes_into_the_live_tensors(tmp_path: Path,
                                              make_config: Callable[..., Config]) -> None:
    model, opt, mgr, saved = _trained(make_config)
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    moments = {t.data_ptr() for st in opt.state.values() for t in st.values()}
    versions = {n: p._version for n, p in model.named_parameters()}
    got = mgr._bg(mgr.restorer.read("latest", False, "all"))
    assert got.in_place == {"model", "optimizer"}
    # written behind torch's back, but autograd is told (as copy_ would tell it)
    assert all(p._version > versions[n] for n, p in model.named_parameters())
    # the decoded trees hold the live tensors themselves, already holding the saved values
    assert state_equal(saved["model"], model.state_dict())
    assert {t.data_ptr() for st in got.trees["optimizer"]["state"].values()
            for t in st.values()} == moments
    res = mgr.restorer.apply(got, "all")
    assert int(res) == 1 and res.resume.exact and not res.resume.resharded
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == ptrs
    assert state_equal(saved["model"], model.state_dict())
    assert state_equal(saved["opt"], opt.state_dict())
    assert {t.data_ptr() for st in opt.state.values() for t in st.values()} == moments
    mgr.close()


def test_a_damaged_index_fails_before_any_write(tmp_path: Path,
                                                make_config: Callable[..., Config]) -> None:
    model, _opt, mgr, _saved = _trained(make_config)
    path = _blob(tmp_path, "model")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # in the index / trailer: checked before any block is decoded
    path.write_bytes(bytes(data))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ChecksumMismatch):
        mgr.restore_sync("latest")
    assert state_equal(before, model.state_dict())  # untouched
    mgr.close()


def test_whole_mode_a_damaged_block_fails_before_any_write_and_falls_back(
        tmp_path: Path, make_config: Callable[..., Config]) -> None:
    model, opt, mgr, saved = _trained(make_config)
    mgr.save_nowait(2).result()  # v000002 is damaged below; v000001 holds ``saved``
    path = _blob(tmp_path, "model").parent.parent / "v000002"
    (blob,) = path.glob("model*.mckp")
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a block
    blob.write_bytes(bytes(data))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ChecksumMismatch):
        mgr.restore_sync("latest", verify="whole")
    assert state_equal(before, model.state_dict())  # verified whole before any write
    assert mgr.restore_sync("latest", fallback=True, verify="whole") == 1
    assert state_equal(saved["model"], model.state_dict())
    assert state_equal(saved["opt"], opt.state_dict())
    mgr.close()


class ChangesUnderneath(LocalStore):
    """A store whose blob changes between the verifying pass and the decoding pass: the
    decoding pass's first block read comes back with a flipped byte."""

    key = ""
    start = -1

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        data = await super().get_range(key, start, length)
        if key == self.key and start == self.start:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0xFF
            return bytes(flipped)
        return data


def test_a_blob_changed_while_decoding_is_reported_as_partially_overwritten(
        tmp_path: Path, make_config: Callable[..., Config]) -> None:
    model, opt, mgr, _saved = _trained(make_config)
    mgr.close()
    blob = _blob(tmp_path, "model")
    store = ChangesUnderneath(tmp_path)
    store.key = str(blob.relative_to(tmp_path))
    store.start = parse_blob(blob.read_bytes()).data_start  # the first block
    mgr = CheckpointManager(make_config(EXTRA), {"model": model, "optimizer": opt},
                            store=store, runs_prefix="runs")
    with pytest.raises(RestoreIncomplete, match="partially overwritten") as info:
        # verify="whole": no fallback over a half-written state (a blob that changes between
        # the two reads is no damage an older version is known to repair)
        mgr.restore_sync("latest", fallback=True, verify="whole")
    assert isinstance(info.value.__cause__, ChecksumMismatch)
    assert info.value.partially_overwritten
    mgr.close()


def test_windows_group_adjacent_blocks_within_the_bound() -> None:
    from mithril_async.codec.container import BlockRef

    blocks = [BlockRef(0, i, 100 + 10 * i, 10) for i in range(5)] + [BlockRef(1, 0, 500, 50)]
    got = group_windows(blocks, 25)
    assert [w for w, _ in got] == [(100, 20), (120, 20), (140, 10), (500, 50)]
    assert sum(len(b) for _, b in got) == 6


def test_uncompressed_blobs_are_copied_into_the_live_tensors(
        tmp_path: Path, make_config: Callable[..., Config]) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from tests.manager.conftest import Batcher

    batcher = Batcher()
    train_step(model, opt, batcher)
    extra = "[checkpointing.compression]\nenabled = false\n"
    mgr = CheckpointManager(make_config(extra), {"model": model, "optimizer": opt})
    mgr.save_nowait(1).result()
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train_step(model, opt, batcher)
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    got = mgr._bg(mgr.restorer.read("latest", False, "all"))
    assert got.in_place == {"model", "optimizer"}
    mgr.restorer.apply(got, "all")
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == ptrs
    assert state_equal(saved[0], model.state_dict())
    assert state_equal(saved[1], opt.state_dict())
    mgr.close()


@pytest.mark.parametrize("compress", [True, False])
def test_a_live_shape_that_differs_is_shape_mismatch_before_any_write(
        tmp_path: Path, make_config: Callable[..., Config], compress: bool) -> None:
    """Every item's header is checked against the live shapes before any item writes: the
    error names the tensor (the model's or its moment's, whichever item is checked first)
    and neither item is written."""
    from mithril_async.errors import ShapeMismatch

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from tests.manager.conftest import Batcher

    train_step(model, opt, Batcher())
    extra = EXTRA if compress else "[checkpointing.compression]\nenabled = false\n"
    with CheckpointManager(make_config(extra), {"model": model, "optimizer": opt}) as mgr:
        mgr.save_nowait(1).result()
    other = TinyNet(vocab=65)  # emb and the last layer have one row more
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    train_step(other, other_opt, Batcher(vocab=65))
    before = copy.deepcopy(other.state_dict()), copy.deepcopy(other_opt.state_dict())
    mgr = CheckpointManager(make_config(extra), {"model": other, "optimizer": other_opt})
    with pytest.raises(ShapeMismatch, match=r"'(emb.weight|state/0/exp_avg)' is "
                                            r"\[65, 32\] here but was saved as \[64, 32\]"):
        mgr.restore_sync("latest")
    mgr.close()
    assert state_equal(before[0], other.state_dict())
    assert state_equal(before[1], other_opt.state_dict())
