"""Issue 19, items 6-12: hostile files run no code, allocate nothing they cannot back, read
nothing outside their run or recording; and hygiene: no secrets recorded, a private bounded
store lock. Each test plants the file as an attacker would (a pickle that creates a marker
file when unpickled, an 811-byte blob claiming a GiB, a header claiming megabytes of JSON, a
symlink, a ``../`` path, a dtype naming a function) and checks the typed error, that the
marker or the outside file was never touched, and, where memory is the point, the peak that
``tracemalloc`` saw (numpy's allocations included): deterministic, unlike RSS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import stat
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
import zstandard

from mithril_async import CheckpointManager, parse_config
from mithril_async.cli import main
from mithril_async.codec.chunk import ChunkMeta, EncodedChunk
from mithril_async.codec.container import (
    HASH,
    PREAMBLE,
    TRAILER,
    TRAILER_SIZE,
    MckpWriter,
    TensorEntry,
)
from mithril_async.codec.container_read import MckpRangeReader, parse_blob
from mithril_async.codec.entropy import PlaneMethod
from mithril_async.codec.state_dict import compress_state_dict
from mithril_async.errors import InvalidFormat, LockTimeout, StorageError, UnsafeKey
from mithril_async.state import TensorDict, flatten_state, unflatten_state
from tests.faults._common import Counter, Net, make_config, matches_step, save_two_versions

GIB = 1 << 30


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` (or the exception it raised) and the peak of traced allocations meanwhile."""
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except Exception as err:
            out = err
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- 6. pickle, Lightning path


class _Plant:
    """Unpickling this creates ``marker``: the stand-in for any code a planted pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


@pytest.fixture
def lightning() -> Any:
    return pytest.importorskip("mithril_async.integrations.lightning")


@pytest.mark.parametrize("how", ["load_checkpoint_file", "plugin", "plugin-weights_only"])
def test_planted_torch_save_checkpoint_runs_no_code(tmp_path: Path, lightning: Any,
                                                    how: str) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "epoch=1.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": _Plant(marker)}, ckpt)
    load: dict[str, Callable[[], Any]] = {
        "load_checkpoint_file": lambda: lightning.load_checkpoint_file(ckpt),
        "plugin": lambda: lightning.MithrilCheckpointIO().load_checkpoint(ckpt),
        # pickle_fallback allows pickle, but Lightning's weights_only=True wins
        "plugin-weights_only": lambda: lightning.MithrilCheckpointIO(
            pickle_fallback=True).load_checkpoint(ckpt, weights_only=True),
    }
    with pytest.raises(InvalidFormat, match=r"epoch=1\.ckpt.*allow_pickle"):
        load[how]()
    assert not marker.exists()
    # the plant is live: a caller who says the file is trusted does run it
    lightning.load_checkpoint_file(ckpt, allow_pickle=True)
    assert marker.exists()


def test_pickled_leaf_stays_packed_when_lightning_says_weights_only(tmp_path: Path,
                                                                   lightning: Any) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "last.ckpt"
    lightning.save_checkpoint_file({"state_dict": {"w": torch.ones(2)}, "obj": _Plant(marker)},
                                   ckpt, pickle_fallback=True)
    io = lightning.MithrilCheckpointIO(pickle_fallback=True)
    with pytest.raises(InvalidFormat, match="allow_pickle"):
        io.load_checkpoint(ckpt, weights_only=True)
    assert not marker.exists()
    # weights_only=False is the caller's explicit trust, even without pickle_fallback
    lightning.MithrilCheckpointIO().load_checkpoint(ckpt, weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------- 7. decode bombs


def _seal(header: bytes, blocks: bytes = b"", index: bytes = b"", count: int = 0) -> bytes:
    """An MCKP blob around a given (zstd) header, every hash right: only the parser behind
    the hashes can refuse it."""
    head = PREAMBLE.pack(b"MCKP", 2, 0, len(header)) + header
    body = head + blocks
    total = len(body) + len(index) + TRAILER_SIZE
    tb = TRAILER.pack(len(header), len(body), len(index), count, xxhash.xxh64_intdigest(head),
                      xxhash.xxh64_intdigest(index), total, 2, b"MCKE", 0)[:-HASH.size]
    out = body + index + tb + HASH.pack(xxhash.xxh64_intdigest(tb))
    return out + HASH.pack(xxhash.xxh64_intdigest(out))


def _json_bomb_blob() -> bytes:
    """A header of ~9 KB (random padding) declaring 8.4 MB of JSON that parses into ~2.8 M
    Python lists (~190 MB): inside the old 1024x bound, far outside the new one."""
    pad = os.urandom(8 << 10).hex()
    doc = b'{"format":"mckp","version":2,"pad":"' + pad.encode() + b'","x":['
    doc += b"[]," * ((8 << 20) // 3) + b"[]]}"
    return _seal(zstandard.ZstdCompressor(level=1).compress(doc))


def test_header_json_bomb_is_refused_before_parsing(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    blob = _json_bomb_blob()
    assert len(blob) < 16 << 10
    err, peak = _peak(lambda: parse_blob(blob))
    assert peak < 24 << 20, f"{peak >> 20} MiB"
    assert isinstance(err, InvalidFormat) and "declares" in str(err), err
    ranged = MckpRangeReader(lambda off, n: blob[off:off + n], len(blob))
    err, peak = _peak(ranged.open)
    assert isinstance(err, InvalidFormat) and peak < 24 << 20, (err, peak >> 20)
    path = tmp_path / "model.mckp"
    path.write_bytes(blob)
    for cmd, rc in (("inspect", 1), ("verify", 3)):
        got, peak = _peak(lambda cmd=cmd: main([cmd, str(path)]))  # type: ignore[misc]
        assert got == rc and peak < 32 << 20, (cmd, got, peak >> 20)
        assert "declares" in capsys.readouterr().err


@functools.cache
def _zeros_hash(n: int) -> int:
    """XXH3-64 of ``n`` zero bytes (the raw hash of a chunk of zeros), computed once per size."""
    h = xxhash.xxh3_64()
    zeros = bytes(1 << 20)
    for _ in range(n >> 20):
        h.update(zeros)
    h.update(bytes(n & ((1 << 20) - 1)))
    return h.intdigest()


def _const_blob(dtype: str, shape: tuple[int, ...],
                metadata: dict[str, Any] | None = None) -> bytes:
    """A valid MCKP blob of a few hundred bytes whose only tensor is zeros of ``dtype`` and
    ``shape`` (at most 1 GiB): one chunk, one constant plane, every hash right (the raw hash
    is of the bytes it decodes to)."""
    entry = TensorEntry.make("w", dtype, shape, GIB)
    meta = ChunkMeta(transform=0, width=1, raw_size=entry.nbytes,
                     raw_xxh64=_zeros_hash(entry.nbytes),
                     payload_xxh64=xxhash.xxh3_64_intdigest(b"\0"),
                     planes=((int(PlaneMethod.CONST), 1),))
    writer = MckpWriter([entry], params={"level": 3}, metadata=metadata)
    return writer.begin() + writer.add(0, 0, EncodedChunk(meta, (b"\0",))) + writer.finish()


def _const_gib_blob(skeleton: Any) -> bytes:
    """A valid MCKP blob of ~800 bytes whose only tensor is 1 GiB of zeros."""
    return _const_blob("uint8", (GIB,), {"mithril.skeleton": json.dumps(skeleton),
                                         "mithril.item": "model"})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/run1 with v000001 and v000002 (model + a data counter), no delta."""
    base = tmp_path_factory.mktemp("hostile-files")
    save_two_versions(base / "runs")
    return base


@pytest.fixture(scope="module")
def gib_blob() -> bytes:
    return _const_gib_blob({"D": [["w", {"T": "w"}]]})


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine / "runs", tmp_path / "runs")
    return tmp_path / "runs" / "run1"


def _edit_manifest(run: Path, edit: Callable[[dict[str, Any]], None], v: str = "v000002"
                   ) -> None:
    path = run / "versions" / v / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _plant_model(run: Path, blob: bytes) -> None:
    """Replace v000002's model blob and re-point the manifest at it (size and hash), as a
    hostile copy of a run would; the recorded raw size stays what the writer measured."""
    (run / "versions" / "v000002" / "model.mckp").write_bytes(blob)
    _edit_manifest(run, lambda d: d["model"].update(bytes=len(blob),
                                                    xxh64=xxhash.xxh64_hexdigest(blob)))


def _restore(run: Path) -> Any:
    model, counter = Net(), Counter()
    with CheckpointManager(make_config(run.parent, delta=False),
                           {"model": model, "data": counter}) as m:
        return m.restore_sync("latest")


@pytest.mark.parametrize("reader", ["verify", "restore-cli", "manager"])
def test_gib_claiming_blob_in_a_run_is_refused_before_allocating(
        run: Path, gib_blob: bytes, reader: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert len(gib_blob) < 1024
    _plant_model(run, gib_blob)
    out = run.parent.parent / "out.safetensors"
    calls: dict[str, Callable[[], Any]] = {
        "verify": lambda: main(["verify", str(run)]),
        "restore-cli": lambda: main(["restore", str(run), "--to", str(out)]),
        "manager": lambda: _restore(run),
    }
    got, peak = _peak(calls[reader])
    assert peak < 200 << 20, f"{peak >> 20} MiB allocated for a {len(gib_blob)}-byte blob"
    if reader == "manager":
        assert isinstance(got, InvalidFormat), got
        msg = str(got)
    else:
        assert got == {"verify": 3, "restore-cli": 1}[reader]
        msg = capsys.readouterr().err
    assert "v000002/model.mckp" in msg and "manifest records" in msg, msg
    assert not out.exists()


def test_blob_decoding_to_other_than_the_recorded_raw_size_is_invalid(run: Path) -> None:
    _edit_manifest(run, lambda d: d["model"].update(raw_bytes=d["model"]["raw_bytes"] + 4))
    # the in-place restore refuses it from the header, before decoding; the tools on decode
    mismatch = r"(decodes to|header declares) \d+ (raw )?bytes, (the )?manifest records"
    with pytest.raises(InvalidFormat, match=mismatch):
        _restore(run)
    assert main(["verify", str(run)]) == 3
    model, counter = Net(), Counter()  # the intact older version is still found
    with CheckpointManager(make_config(run.parent, delta=False),
                           {"model": model, "data": counter}) as m:
        assert m.restore_sync("latest", fallback=True) == 1
    assert matches_step(model, counter, 1)


def test_verify_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    """8 tensors of 8 MiB (zeros: a tiny blob) must never be decoded all at once."""
    tensors = {f"t{i}": torch.zeros(2 << 20) for i in range(8)}
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path / "runs"}"\nrun_id = "r"\n'
                       "[checkpointing.compression]\nthreads = 1\n")
    with CheckpointManager(cfg, {"model": TensorDict(tensors)}) as m:
        m.save_nowait(1).result()
    rc, peak = _peak(lambda: main(["verify", str(tmp_path / "runs" / "r")]))
    assert rc == 0
    assert peak < 32 << 20, f"{peak >> 20} MiB for 64 MiB of tensors"


# ---------------------------------------------------------------- DCP: the registered decoder


class _Call:
    """Pickles as a call of the DCP decoder on ``blob``: what a planted ``.distcp`` item holds
    (``torch.load(weights_only=True)`` runs it in any process that imported the module)."""

    def __init__(self, blob: torch.Tensor) -> None:
        self.blob = blob

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from mithril_async.integrations.torch_dcp import mithril_compressed_tensor

        return mithril_compressed_tensor, (self.blob, 1)


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _u8(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _dcp_checkpoint(folder: Path, item: bytes, chunk: tuple[int, int] | None) -> None:
    """A real checkpoint of ``w`` (64 x 64 fp32) whose item for ``w`` is replaced by ``item``
    (a file of its own, the ``.metadata`` pointed at it), and optionally its recorded chunk
    size by ``chunk``, as a hostile copy of the folder would."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from mithril_async.integrations.torch_dcp import MithrilSavePlanner

    dcp.save({"w": torch.randn(64, 64), "step": 1}, storage_writer=dcp.FileSystemWriter(folder),
             planner=MithrilSavePlanner())
    (folder / "__planted.distcp").write_bytes(item)
    md = pickle.loads((folder / ".metadata").read_bytes())  # written just above: ours
    index = next(i for i in md.storage_data if i.fqn == "w")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], offset=0,
                                                 relative_path="__planted.distcp",
                                                 length=len(item))
    if chunk is not None:
        md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(
            offsets=torch.Size([0, 0]), sizes=torch.Size(chunk))
    (folder / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(("plant", "planner", "refusal"), [
    ("gib", "default", "more than 65536 times its size"),
    ("gib", "mithril", r"declares uint8 \[1073741824\], the checkpoint's metadata says float32"),
    ("grown-chunk", "default", "more than 65536 times its size"),
    ("grown-chunk", "mithril", r"chunk of size \[4194304, 64\] .* outside the tensor's size"),
], ids=["gib-default", "gib-ours", "grown-chunk-default", "grown-chunk-ours"])
def test_dcp_item_declaring_a_gib_is_refused_before_allocating(
        tmp_path: Path, plant: str, planner: str, refusal: str) -> None:
    """A 2 KB ``.distcp`` item whose blob declares 1 GiB of zeros, loaded by ``dcp.load``
    with DCP's default planner (the registered decoder inside ``torch.load``, bounded by the
    blob's size) and with ours (bounded by the checkpoint's metadata: the item must hold the
    chunk's dtype and shape, and the chunk must lie inside the tensor, which DCP compares
    with the live one). ``grown-chunk`` also grows the chunk the metadata records to match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from mithril_async.integrations.torch_dcp import MithrilLoadPlanner

    shape = (GIB,) if plant == "gib" else (GIB >> 8, 64)
    item = _saved(_Call(_u8(_const_blob("uint8" if plant == "gib" else "float32", shape))))
    assert len(item) < 2100
    _dcp_checkpoint(tmp_path / "c", item, None if plant == "gib" else shape)  # type: ignore[arg-type]
    sd = {"w": torch.zeros(64, 64), "step": 0}
    kwargs = {"planner": MithrilLoadPlanner()} if planner == "mithril" else {}

    def load() -> BaseException | None:
        try:
            dcp.load(sd, checkpoint_id=tmp_path / "c", **kwargs)
        except CheckpointException as err:
            return next(iter(err.failures.values()))[0]  # (exception, traceback) of rank 0
        return None

    err, peak = _peak(load)
    assert peak < 64 << 20, f"{peak >> 20} MiB allocated for a {len(item)}-byte item"
    assert isinstance(err, InvalidFormat) and re.search(refusal, str(err)), err
    assert torch.equal(sd["w"], torch.zeros(64, 64))


def test_planted_item_loaded_anywhere_is_bounded_by_its_size(tmp_path: Path) -> None:
    """Any ``torch.load(weights_only=True)`` in a process that imported the DCP module: the
    2 KB item declaring a GiB; one blob passed to the decoder twice (each call within the
    bound, together not); a one-byte storage viewed as a GiB (stride 0)."""
    import mithril_async.integrations.torch_dcp as td

    small = _const_blob("uint8", (16 << 20,))
    assert 16 << 20 <= len(small) * td.MAX_ITEM_RATIO < 32 << 20  # one call fits, two do not
    blob = _u8(small)
    plants = {
        "gib": (_saved(_Call(_u8(_const_blob("uint8", (GIB,))))), "times its size", 64),
        "twice": (_saved([_Call(blob), _Call(blob)]), "times its size", 28),
        "stride-0": (_saved(_Call(torch.tensor([77], dtype=torch.uint8).expand(GIB))),
                     "not a contiguous", 64),
    }
    for name, (item, refusal, mib) in plants.items():
        path = tmp_path / f"{name}.distcp"
        path.write_bytes(item)
        err, peak = _peak(lambda path=path: torch.load(path, weights_only=True))  # type: ignore[misc]
        assert isinstance(err, InvalidFormat) and refusal in str(err), (name, err)
        assert peak < mib << 20, (name, peak >> 20)
    one = torch.load(io.BytesIO(_saved(_Call(blob))), weights_only=True)  # within the bound
    assert one.shape == (16 << 20,) and not one.any()


# ---------------------------------------------------------------- 9. paths leaving the run


def test_inspect_refuses_a_blob_planted_as_a_symlink(pristine: Path, run: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    secret = run.parent.parent / "secret.mckp"  # outside the run: must never be read
    secret.write_bytes(compress_state_dict({"SECRET_TENSOR": torch.ones(3)}))
    blob = run / "versions" / "v000001" / "model.mckp"
    blob.unlink()
    blob.symlink_to(secret)
    assert main(["inspect", str(run / "versions" / "v000001")]) == 1
    cap = capsys.readouterr()
    assert "symlink" in cap.err and "SECRET_TENSOR" not in cap.out + cap.err


def test_manifest_config_key_outside_the_run_is_refused(run: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    secret = run.parent.parent / "secret.toml"  # beside runs/: a key of the store root
    secret.write_bytes(b"password = 'hunter2'\n")
    data = secret.read_bytes()
    _edit_manifest(run, lambda d: d.__setitem__("config", {
        "key": "secret.toml", "bytes": len(data), "xxh64": xxhash.xxh64_hexdigest(data),
        "format": "toml"}))
    assert main(["verify", str(run / "versions" / "v000002")]) == 3
    assert "config key 'secret.toml' outside its run" in capsys.readouterr().err
    with pytest.raises(InvalidFormat, match="outside its run"):
        _restore(run)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mithril_async.step_deltas import SparseDeltaRecorder

    d = tmp_path_factory.mktemp("deltas") / "rec"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    with SparseDeltaRecorder(model, d, dtype=torch.float32) as rec:
        for step in (1, 2):
            with torch.no_grad():
                model.weight[step, :3] += 1.0
            rec.record(step)
    return d


def _meta_edit(kind: str) -> Callable[[Path, dict[str, Any]], None]:
    def edit(d: Path, meta: dict[str, Any]) -> None:
        first = meta["checkpoints"][0]
        outside = d.parent / "elsewhere"
        outside.mkdir()
        shutil.copy(d / first["path"], outside / first["path"])
        if kind == "dotdot":
            first["path"] = f"../elsewhere/{first['path']}"
        elif kind == "absolute":
            first["path"] = str(outside / first["path"])
        elif kind == "symlink":
            (d / first["path"]).unlink()
            (d / first["path"]).symlink_to(outside / first["path"])
        elif kind == "base-dotdot":
            shutil.copy(d / meta["base"], outside / meta["base"])
            meta["base"] = f"../elsewhere/{meta['base']}"
    return edit


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "base-dotdot"])
def test_sparse_delta_metadata_paths_stay_in_the_recording(recording: Path, tmp_path: Path,
                                                           kind: str) -> None:
    from mithril_async.step_deltas import compute_analysis, reconstruct_weights_at_step

    d = tmp_path / "rec"
    shutil.copytree(recording, d)
    meta = json.loads((d / "metadata.json").read_text())
    _meta_edit(kind)(d, meta)
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(UnsafeKey, match="symlink" if kind == "symlink" else "inside"):
        reconstruct_weights_at_step(None, d, 2)
    if kind != "base-dotdot":  # the analysis reads deltas only
        with pytest.raises(UnsafeKey):
            compute_analysis(d)


@pytest.mark.parametrize("node", [{"dt": "load"}, {"dt": "ops"}, {"np": "V8", "v": 8},
                                  {"np": "O", "v": 1}])
def test_skeleton_names_only_allowed_types(node: dict[str, Any]) -> None:
    with pytest.raises(InvalidFormat, match="skeleton names"):
        unflatten_state({"D": [["x", node]]}, {})
    skel, tensors = flatten_state({"dt": torch.bfloat16, "q": torch.quint8, "n": torch.ones(1)})
    assert unflatten_state(skel, tensors)["q"] is torch.quint8  # every real dtype still loads


def test_blob_skeleton_naming_a_function_is_refused_on_restore(run: Path) -> None:
    """End to end: a hostile skeleton ``{"dt": "load"}`` in a run's model blob."""
    model = Net()
    skel, tensors = flatten_state(model.state_dict())
    skel["D"].append(["extra", {"dt": "load"}])
    blob = compress_state_dict(tensors, metadata={"mithril.skeleton": json.dumps(skel),
                                                  "mithril.item": "model"})
    _plant_model(run, blob)
    with pytest.raises(InvalidFormat, match="unknown torch dtype 'load'"):
        _restore(run)


# ---------------------------------------------------------------- 10. secrets in the run

SECRET_TOML = """\
[checkpointing]
runs_path = "{runs}"
run_id = "run1"
record_config = ["model"]
[checkpointing.compression]
threads = 1
keyframe_interval = 4
[model]
width = 16
hf_token = "hf_SECRET1"
[model.db]
url = "postgres://trainer:SECRET2@db.internal/runs"
[wandb]
api_key = "SECRET3"
[database]
password = "SECRET4"
"""


def test_recorded_config_keeps_named_tables_redacted_and_private(tmp_path: Path) -> None:
    import tomllib

    cfg = parse_config(SECRET_TOML.format(runs=tmp_path / "runs"))
    model = Net(8)
    with CheckpointManager(cfg, {"model": model}) as m:
        m.save_nowait(1).result()
    cdir = tmp_path / "runs" / "run1" / "config"
    toml_bytes, json_bytes = (cdir / "train.toml").read_bytes(), (cdir / "config.json").read_bytes()
    for data in (toml_bytes, json_bytes):
        assert b"SECRET" not in data
    toml = tomllib.loads(toml_bytes.decode())
    assert set(toml) == {"checkpointing", "model"}
    assert toml["model"] == {"width": 16, "hf_token": "<redacted>",
                             "db": {"url": "postgres://trainer:<redacted>@db.internal/runs"}}
    assert toml["checkpointing"]["compression"] == {"threads": 1, "keyframe_interval": 4}
    doc = json.loads(json_bytes)
    assert set(doc) == {"checkpointing", "model"} and doc["model"]["hf_token"] == "<redacted>"
    assert doc["checkpointing"]["compression"]["keyframe_interval"] == 4
    for p in (cdir / "train.toml", cdir / "config.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_record_config_must_name_tables_that_exist(tmp_path: Path) -> None:
    from mithril_async.errors import ConfigError

    with pytest.raises(ConfigError, match="record_config names \\['modle'\\]"):
        parse_config('[checkpointing]\nrecord_config = ["modle"]\n[model]\nwidth = 1\n')


def test_mirror_store_writes_private_files_privately(tmp_path: Path) -> None:
    from mithril_async.storage.base import put_private
    from mithril_async.storage.local import LocalStore
    from mithril_async.storage.memory import MemoryStore
    from mithril_async.storage.mirror import MirrorStore

    remote = MemoryStore()  # no put_private: a plain put
    store = MirrorStore(LocalStore(tmp_path), remote)
    asyncio.run(put_private(store, "runs/r/config/train.toml", b"x"))
    assert stat.S_IMODE((tmp_path / "runs/r/config/train.toml").stat().st_mode) == 0o600
    assert asyncio.run(remote.get("runs/r/config/train.toml")) == b"x"


@pytest.mark.parametrize("value", [
    {"a": 1, "t": {"s": "q\"\\\n\x7f é", "f": 1.5e-300, "i": float("inf"), "b": False,
                   "l": [1, [2, "x"], {"k k": "v"}], "e": {}}},
    {"top": "level", "x": {"y": {"z": {"w": -3}}}},
])
def test_toml_writer_round_trips(value: dict[str, Any]) -> None:
    import tomllib

    from mithril_async.config import to_toml

    assert tomllib.loads(to_toml(value)) == value


@pytest.mark.parametrize(("key", "secret"), [
    ("hf_token", True), ("apiKey", True), ("aws_secret_access_key", True), ("PASSWORD", True),
    ("credentials", True), ("authtoken", True), ("keyframe_interval", False),
    ("tokenizer", False), ("max_tokens", False), ("monkey_patch", False)])
def test_secret_looking_keys(key: str, secret: bool) -> None:
    from mithril_async.config import is_secret_key

    assert is_secret_key(key) is secret


# ---------------------------------------------------------------- 11. the store lock


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[Path]:
    """The store's lock file, held by another process until the test ends."""
    lock = tmp_path / ".tmp-cas.lock"
    lock.touch(mode=0o755)
    os.chmod(lock, 0o755)  # as older versions left it
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys\n"
         f"fd = os.open({str(lock)!r}, os.O_RDONLY)\n"  # read access is enough to flock
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield lock
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)


def test_store_lock_wait_is_bounded_and_the_lock_private(tmp_path: Path, held_lock: Path
                                                         ) -> None:
    from mithril_async.storage.local import LocalStore

    store = LocalStore(tmp_path, lock_timeout_s=0.2)
    with pytest.raises(LockTimeout, match=r"\.tmp-cas\.lock") as info:
        asyncio.run(store.put_if_match("runs/r/aliases/latest.json", b"{}", None))
    assert isinstance(info.value, StorageError) and isinstance(info.value, TimeoutError)
    assert not (tmp_path / "runs/r/aliases/latest.json").exists()
    assert stat.S_IMODE(held_lock.stat().st_mode) == 0o600  # tightened: it is ours


def test_store_lock_file_is_created_private(tmp_path: Path) -> None:
    from mithril_async.storage.local import LocalStore

    asyncio.run(LocalStore(tmp_path).put_if_match("k", b"v", None))
    assert stat.S_IMODE((tmp_path / ".tmp-cas.lock").stat().st_mode) == 0o600
