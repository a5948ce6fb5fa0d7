"""export_hf without transformers: the split and names Hugging Face uses, every kind of
blob, the memory bound, overwrites, errors, the recorded files' checks, export on close."""

from __future__ import annotations

import asyncio
import os
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mithril_async import CheckpointManager, parse_config
from mithril_async.catalog import open_catalog
from mithril_async.errors import ChecksumMismatch, ConfigError, VersionNotFound
from mithril_async.export import OutputExists, export_hf, parse_size
from mithril_async.export.hf import natural_key, plan_shards, shard_names
from mithril_async.export.hf_files import write_hf_files
from mithril_async.restore.reader import read_version
from tests.manager.conftest import make_state, train_step


def _load(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _config(runs: Path, extra: str = "", **ck: Any) -> Any:
    lines = "".join(f"{k} = {v}\n" for k, v in ck.items())
    return parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "r"\n{lines}{extra}')


def _saved(runs: Path, state: Any, extra: str = "", steps: int = 1) -> Path:
    with CheckpointManager(_config(runs, extra), {"model": state}) as mgr:
        for s in range(1, steps + 1):
            mgr.save_nowait(s).result()
    return runs / "r"


def test_the_split_is_huggingface_hubs() -> None:
    hub = pytest.importorskip("huggingface_hub.serialization")
    rng = random.Random(0)
    for limit in (50, 100, 1000):
        sizes = [(f"t{i}", rng.randint(1, 120)) for i in range(40)]
        sd = {n: torch.empty(s, dtype=torch.uint8) for n, s in sizes}
        want = hub.split_torch_state_dict_into_shards(
            sd, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
        groups = plan_shards(sizes, limit)
        assert dict(zip(shard_names(len(groups)), groups, strict=True)) == \
            want.filename_to_tensors, limit
    assert shard_names(1) == ["model.safetensors"]


def test_names_sort_as_transformers_sorts_them() -> None:
    names = ["layers.10.w", "layers.2.w", "layers.2.b", "a10", "a2", "a", "emb.weight", "1"]
    order = sorted(names, key=natural_key)
    assert order == ["1", "a", "a2", "a10", "emb.weight", "layers.2.b", "layers.2.w",
                     "layers.10.w"]
    tf = pytest.importorskip("transformers.core_model_loading")
    assert order == sorted(names, key=tf.dot_natural_key)


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("20MB", 20 * 10**6),
                                            ("1.5GiB", 3 << 29), ("100", 100), (7, 7),
                                            ("40 kb", 40_000)])
def test_sizes(text: Any, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["5XB", "", "GB", "-1GB", "0", 0, True, "1e3MB"])
def test_bad_sizes_are_config_errors(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_shard_size"):
        parse_size(bad)


@pytest.mark.parametrize("extra", ["", "[checkpointing.compression]\nenabled = false\n",
                                   "[checkpointing.compression]\ndelta = true\nchunk_mib = 0.01\n"])
def test_every_kind_of_blob_exports_exactly(tmp_path: Path, extra: str) -> None:
    """MCKP, safetensors (compression off), and a delta version: its deltas decoded against
    their base."""
    model, opt, batcher = make_state()
    with CheckpointManager(_config(tmp_path / "runs", extra), {"model": model}) as mgr:
        for s in (1, 2):
            train_step(model, opt, batcher)
            mgr.save_nowait(s).result()
    res = export_hf(tmp_path / "runs" / "r", tmp_path / "out", max_shard_size="8KB")
    assert len(res.shards) > 2 and res.step == 2
    got, want = _load(tmp_path / "out"), model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_memory_stays_at_one_file_plus_the_budget(tmp_path: Path) -> None:
    """16 tensors of 2 MiB: exported into files of one tensor each, the export's peak of
    traced allocations (reads, decode buffers, the full-size targets) stays under two files
    plus the in-flight budget; in one file it is the whole model (the measure sees it)."""
    torch.manual_seed(0)
    state = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(512, 1024))
                                    for i in range(16)})
    run = _saved(tmp_path / "runs", state)
    model_bytes = 16 * (2 << 20)
    peaks = {}
    for limit in ("4MB", "5GB"):
        tracemalloc.start()
        try:
            res = export_hf(run, tmp_path / limit, max_shard_size=limit, inflight_mib=8)
            peaks[limit] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert res.total_size == model_bytes
    assert len(res.shards) == 1
    assert peaks["4MB"] < 2 * 4_000_000 + (8 << 20) < model_bytes
    assert peaks["5GB"] >= model_bytes
    got = _load(tmp_path / "4MB")
    assert all(torch.equal(got[k], v) for k, v in state.state_dict().items())


def test_a_folder_that_is_not_empty_is_refused_and_force_replaces_weight_files(
        tmp_path: Path) -> None:
    run = _saved(tmp_path / "runs", torch.nn.Linear(4, 3))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("README.md", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (out / name).write_text("an earlier export")
    with pytest.raises(OutputExists, match="not empty"):
        export_hf(run, out)
    assert (out / "model.safetensors.index.json").read_text() == "an earlier export"
    export_hf(run, out, force=True)  # stale weight files go: from_pretrained would read them
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputExists, match="not a folder"):
        export_hf(run, tmp_path / "file", force=True)


def test_bad_requests_are_typed_errors_and_write_nothing(tmp_path: Path) -> None:
    run = _saved(tmp_path / "runs", torch.nn.Linear(4, 3))
    out = tmp_path / "out"
    with pytest.raises(VersionNotFound, match="v000007"):
        export_hf(run, out, version="v000007")
    with pytest.raises(VersionNotFound, match="no committed version at step 9"):
        export_hf(run, out, version=9)
    with pytest.raises(VersionNotFound, match="has no 'optimizer' state"):
        export_hf(run, out, item="optimizer")
    with pytest.raises(ConfigError, match="dtype"):
        export_hf(run, out, dtype="int8")
    assert not out.exists()
    assert export_hf(run, out, version=1).version_id == "v000001"


def test_recorded_files_are_copied_and_a_damaged_one_is_refused(tmp_path: Path) -> None:
    run = _saved(tmp_path / "runs", torch.nn.Linear(4, 3))
    catalog = open_catalog(run.parent, run.name)
    files = {"config.json": b'{\n  "dtype": "float32",\n  "model_type": "bert"\n}\n',
             "tokenizer.json": b"{}"}
    asyncio.run(write_hf_files(catalog.store, catalog.layout, files))
    res = export_hf(run, tmp_path / "a", dtype="float16")
    assert res.copied == ["config.json", "tokenizer.json"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == b"{}"
    # the config says the dtype the export cast to, formatted as transformers writes it
    assert (tmp_path / "a" / "config.json").read_bytes() == \
        b'{\n  "dtype": "float16",\n  "model_type": "bert"\n}\n'
    assert export_hf(run, tmp_path / "b", item="model").copied == res.copied
    (run / "config" / "hf" / "tokenizer.json").write_bytes(b"[]")  # same size, other bytes
    with pytest.raises(ChecksumMismatch, match=r"tokenizer\.json"):
        export_hf(run, tmp_path / "c")
    assert not (tmp_path / "c").exists()


LOSSY = """[checkpointing.lossy]
enabled = true
density = 0.05
keyframe_every = 4
"""


def test_a_lossy_version_exports_its_reconstruction(tmp_path: Path) -> None:
    model, opt, batcher = make_state()
    with CheckpointManager(_config(tmp_path / "runs", LOSSY),
                           {"model": model, "optimizer": opt}) as mgr:
        for s in (1, 2):
            train_step(model, opt, batcher)
            mgr.save_nowait(s).result()
    run = tmp_path / "runs" / "r"
    got = _load(Path(export_hf(run, tmp_path / "out").out_dir))
    want = asyncio.run(read_version(open_catalog(run.parent, run.name), "latest",
                                    items={"model"}, rng=False)).trees["model"]
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["mlp.0.weight"], model.state_dict()["mlp.0.weight"])


def test_export_on_close(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    model = torch.nn.Linear(4, 3)
    with CheckpointManager(_config(runs, export_hf_on_close="true"), {"model": model}) as m:
        m.save_nowait(1).result()
        torch.nn.init.zeros_(model.weight)
        m.save_nowait(2).result()
    folder = runs / "r" / "export" / "hf"
    assert torch.equal(load_file(str(folder / "model.safetensors"))["weight"], model.weight)
    # a folder of one's own; an earlier export there is replaced
    where = tmp_path / "mine"
    where.mkdir()
    (where / "model.safetensors").write_text("old")
    with CheckpointManager(_config(runs, export_hf_on_close=f'"{where}"'),
                           {"model": model}) as m:
        torch.nn.init.ones_(model.weight)
        m.save_nowait(3).result()
    assert torch.equal(load_file(str(where / "model.safetensors"))["weight"], model.weight)
    # not when the manager leaves on an exception, nor after it committed nothing
    other = tmp_path / "other"
    with pytest.raises(KeyError), CheckpointManager(
            _config(runs, export_hf_on_close=f'"{other}"'), {"model": model}) as m:
        m.save_nowait(4).result()
        raise KeyError("training failed")
    reader = CheckpointManager(_config(runs, export_hf_on_close=f'"{other}"'),
                               {"model": model})
    assert reader.latest_step() == 4
    reader.close()
    assert not other.exists()
    with pytest.raises(ConfigError, match="export_hf_on_close"):
        _config(runs, export_hf_on_close='" "')


def test_a_failed_export_on_close_is_raised(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file where the folder goes")
    m = CheckpointManager(_config(tmp_path / "runs", export_hf_on_close=f'"{tmp_path}/taken"'),
                          {"model": torch.nn.Linear(4, 3)})
    m.save_nowait(1).result()
    with pytest.raises(OutputExists, match="not a folder"):
        m.close()
    with pytest.raises(RuntimeError, match="closed"):  # it closed all the same
        m.save_nowait(2)
    assert (tmp_path / "runs" / "r" / "versions" / "v000001" / "manifest.json").exists()


def test_an_export_that_fails_midway_leaves_nothing(tmp_path: Path) -> None:
    """Damage in a late tensor is found after earlier files were written: they go again."""
    torch.manual_seed(0)
    state = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(64, 64))
                                    for i in range(8)})
    run = _saved(tmp_path / "runs", state, "[checkpointing.compression]\nchunk_mib = 0.01\n")
    blob = run / "versions" / "v000001" / "model.mckp"
    data = bytearray(blob.read_bytes())
    data[int(len(data) * 0.8)] ^= 0x01  # w6 or w7: the last files
    blob.write_bytes(bytes(data))
    progress: list[int] = []
    with pytest.raises(ChecksumMismatch, match=r"model\.mckp"):
        export_hf(run, tmp_path / "out", max_shard_size="16KB",
                  on_progress=lambda done, total: progress.append(done))
    assert len(progress) >= 3  # files were written before the damage was met
    assert not (tmp_path / "out").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(ChecksumMismatch):
        export_hf(run, mine, max_shard_size="16KB")
    assert list(mine.iterdir()) == []  # a folder it did not make stays, emptied of its files


def _damage_late(blob: Path) -> None:
    data = bytearray(blob.read_bytes())
    data[int(len(data) * 0.8)] ^= 0x01  # a late tensor: found after files were written
    blob.write_bytes(bytes(data))


def _siblings(folder: Path) -> list[str]:
    """What an export left beside ``folder`` (its replacement, a previous one set aside)."""
    return sorted(p.name for p in folder.parent.iterdir()
                  if p.name.startswith(f".{folder.name}."))


def test_a_failed_forced_export_leaves_the_previous_one_intact(tmp_path: Path) -> None:
    """A forced export over an earlier one replaces it only once complete: one that fails
    midway (damage found after files were written) leaves the earlier export whole, the
    folder's other files too; one that succeeds replaces it."""
    torch.manual_seed(0)
    state = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(64, 64))
                                    for i in range(8)})
    run = _saved(tmp_path / "runs", state, "[checkpointing.compression]\nchunk_mib = 0.01\n",
                 steps=2)
    out = tmp_path / "out"
    first = export_hf(run, out, version=1, max_shard_size="16KB")
    (out / "README.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _damage_late(run / "versions" / "v000002" / "model.mckp")
    progress: list[int] = []
    with pytest.raises(ChecksumMismatch, match=r"model\.mckp"):
        export_hf(run, out, version=2, max_shard_size="16KB", force=True,
                  on_progress=lambda done, total: progress.append(done))
    assert len(progress) >= 3  # files were written before the damage was met
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _siblings(out) == []
    got = _load(out)
    assert len(first.shards) > 1 and set(got) == set(state.state_dict())
    want = asyncio.run(read_version(open_catalog(run.parent, run.name), "v000001",
                                    items={"model"}, rng=False)).trees["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    # a forced export that succeeds replaces it: other files kept, old weight files gone
    res = export_hf(run, out, version=1, max_shard_size="1GB", force=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]
    assert res.shards == ["model.safetensors"] and (out / "README.md").read_text() == "mine"
    assert all(torch.equal(_load(out)[k], want[k]) for k in want)
    assert _siblings(out) == []


def test_a_failed_export_on_close_leaves_the_previous_export(tmp_path: Path) -> None:
    """``export_hf_on_close`` always replaces: when the new export fails, the one of the
    previous manager stays whole and loads."""
    runs = tmp_path / "runs"
    model = torch.nn.Linear(64, 64)
    torch.nn.init.ones_(model.weight)
    with CheckpointManager(_config(runs, export_hf_on_close="true"), {"model": model}) as m:
        m.save_nowait(1).result()
    folder = runs / "r" / "export" / "hf"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    m = CheckpointManager(_config(runs, export_hf_on_close="true"), {"model": model})
    torch.nn.init.zeros_(model.weight)
    assert m.save_nowait(2).result().status == "committed"
    _damage_late(runs / "r" / "versions" / "v000002" / "model.mckp")
    with pytest.raises(ChecksumMismatch):
        m.close()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert torch.equal(load_file(str(folder / "model.safetensors"))["weight"],
                       torch.ones(64, 64))
    assert _siblings(folder) == []


@pytest.mark.parametrize("exchange", [True, False])
def test_a_folder_is_swapped_in_whole_by_either_swap(tmp_path: Path, exchange: bool) -> None:
    """The atomic exchange, and the two renames used where it is missing: the complete
    replacement takes the name, the previous folder goes, nothing is left beside it; the
    previous folder's carried entries (a file, a link, a subfolder) come along."""
    from mithril_async.export.replace import discard, new_sibling, swap_in

    target = tmp_path / "out"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "notes.txt").write_text("kept")
    (target / "README.md").write_text("kept")
    (target / "model.safetensors").write_text("old weights")
    (target / "link").symlink_to("README.md")
    work = new_sibling(target, lambda name: name != "model.safetensors")
    assert sorted(p.name for p in work.iterdir()) == ["README.md", "link", "sub"]
    (work / "model.safetensors").write_text("new weights")
    assert (target / "model.safetensors").read_text() == "old weights"
    swap_in(work, target, exchange=exchange)
    assert (target / "model.safetensors").read_text() == "new weights"
    assert (target / "sub" / "notes.txt").read_text() == "kept"
    assert os.readlink(target / "link") == "README.md"
    assert _siblings(target) == []
    fresh = tmp_path / "deep" / "new"  # no folder yet: parents made, then renamed in
    work = new_sibling(fresh, lambda name: True)
    (work / "f").write_text("x")
    swap_in(work, fresh, exchange=exchange)
    assert (fresh / "f").read_text() == "x" and _siblings(fresh) == []
    work = new_sibling(fresh, lambda name: True)
    discard(work)
    assert (fresh / "f").read_text() == "x" and _siblings(fresh) == []
