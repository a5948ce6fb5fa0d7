"""JAX / Orbax: our type handlers inside Orbax's own Checkpointer and CheckpointManager.

Real jax + orbax-checkpoint on the CPU with 8 virtual devices (``_orbax_env``): arrays
sharded over a 2x2 mesh, restored into other meshes, single devices and numpy; Orbax's
async CheckpointManager with retention and Composite items; checkpoints written by Orbax's
own handlers; damaged files; a reader without our handlers.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import mithril_async.integrations.orbax.type_handlers as th
from mithril_async.codec.container_read import MckpRangeReader
from mithril_async.errors import ChecksumMismatch, ConfigError
from mithril_async.integrations.orbax import (
    MithrilCheckpointHandler,
    MithrilRestore,
    MithrilSave,
    disable_globally,
    enable_globally,
)
from mithril_async.integrations.orbax.blobs import SavedItem
from mithril_async.integrations.orbax.layout import is_blob_name
from tests.integrations._orbax_env import devices  # sets XLA_FLAGS


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2), ("x", "y"), devices=devices()[:4])


def _bits(x: Any) -> np.ndarray[Any, Any]:
    a = np.asarray(x)
    return a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)


def _same_leaf(x: Any, y: Any) -> bool:
    if not hasattr(x, "dtype"):  # Python scalars and strings
        return type(x) is type(y) and x == y
    return (np.dtype(x.dtype) == np.dtype(y.dtype) and np.shape(x) == np.shape(y)
            and np.array_equal(_bits(x), _bits(y)))


def same_bits(a: Any, b: Any) -> bool:
    """Same tree; arrays of equal dtype, shape and bytes (NaN payloads and -0.0 included)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(_same_leaf(x, y) for x, y in zip(la, lb, strict=True))


def random_bits(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """Every bit pattern is possible (NaN payloads, infinities, -0.0); bools 0/1."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dt.itemsize,
                                               dtype=np.uint8)
    if dt == np.bool_:
        raw &= 1
    return raw.view(dt).reshape(shape)


def sharded(x: Any, mesh: jax.sharding.Mesh, *spec: Any) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def abstract(tree: Any, sharding: Any = None) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding(x) if sharding else x.sharding), tree)


def restore_args_for(target: Any) -> MithrilRestore:
    return MithrilRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def blobs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if is_blob_name(p.name))


@pytest.fixture
def state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    w = random_bits(jnp.bfloat16, (8, 16), 1)
    return {"w": sharded(w, mesh, "x", "y"),
            "b": sharded(np.arange(8, dtype=np.float32), mesh, "x"),
            "step": 7, "name": "run-a"}


@pytest.fixture
def ckptr() -> Iterator[ocp.Checkpointer]:
    c = ocp.Checkpointer(MithrilCheckpointHandler(compression_level=3))
    yield c
    c.close()


DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8,
          jnp.int32, jnp.uint8, jnp.uint32, jnp.bool_]


def test_every_dtype_and_0d_round_trip_bit_exact(tmp_path: Path, mesh: jax.sharding.Mesh,
                                                 ckptr: ocp.Checkpointer) -> None:
    tree = {np.dtype(dt).name: sharded(random_bits(dt, (4, 8), i), mesh, "x", "y")
            for i, dt in enumerate(DTYPES)}
    tree["scalar_f32"] = jax.device_put(random_bits(jnp.float32, (), 50))
    tree["scalar_bf16"] = sharded(random_bits(jnp.bfloat16, (), 51), mesh)
    tree["replicated"] = sharded(random_bits(jnp.float32, (3, 5), 52), mesh)
    tree["np_f64"] = random_bits(np.float64, (3, 3), 53)
    ckptr.save(tmp_path / "c", args=MithrilSave(tree))
    assert blobs(tmp_path / "c")
    out = ckptr.restore(tmp_path / "c")
    assert same_bits(out, tree)
    assert out["bfloat16"].sharding.is_equivalent_to(tree["bfloat16"].sharding, 2)
    assert isinstance(out["np_f64"], np.ndarray)


def test_restore_into_other_shardings_and_devices(tmp_path: Path, mesh: jax.sharding.Mesh,
                                                  state: dict[str, Any],
                                                  ckptr: ocp.Checkpointer) -> None:
    ckptr.save(tmp_path / "c", args=MithrilSave(state))
    arrays = {"w": state["w"], "b": state["b"]}
    big = jax.make_mesh((4, 2), ("a", "b"), devices=devices())
    for target in (
        lambda x: NamedSharding(big, P("b", "a") if x.ndim == 2 else P("a")),  # 8 devices
        lambda x: NamedSharding(big, P()),  # replicated everywhere
        lambda x: SingleDeviceSharding(devices()[5]),
    ):
        want = abstract(arrays, target)
        out = ckptr.restore(tmp_path / "c", args=MithrilRestore(
            want, restore_args=ocp.checkpoint_utils.construct_restore_args(want),
            partial_restore=True))
        assert same_bits(out, arrays)
        for k in arrays:
            assert out[k].sharding == want[k].sharding
    by_mesh = {"w": ocp.ArrayRestoreArgs(mesh=big, mesh_axes=P(None, "a")),
               "b": ocp.ArrayRestoreArgs(mesh=big, mesh_axes=P("b"))}
    out = ckptr.restore(tmp_path / "c", args=MithrilRestore(
        {"w": 0, "b": 0}, restore_args=by_mesh, partial_restore=True))
    assert same_bits(out, arrays) and out["w"].sharding.spec == P(None, "a")


def test_no_target_reproduces_the_saved_sharding_or_raises_orbaxs_topology_error(
        tmp_path: Path, state: dict[str, Any], ckptr: ocp.Checkpointer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ckptr.save(tmp_path / "c", args=MithrilSave(state))
    out = ckptr.restore(tmp_path / "c")
    assert same_bits(out, state)
    assert out["w"].sharding == state["w"].sharding and out["step"] == 7
    meta = ckptr.metadata(tmp_path / "c").item_metadata.tree
    assert meta["w"].shape == (8, 16) and meta["w"].dtype == jnp.bfloat16
    assert meta["w"].sharding.to_jax_sharding() == state["w"].sharding
    # the saved mesh's devices 2 and 3 do not exist here: Orbax's own error, nothing restored
    two = devices()[:2]
    monkeypatch.setattr(jax, "devices", lambda *a: two)
    with pytest.raises(ValueError, match="different from the devices used to save"):
        ckptr.restore(tmp_path / "c")


def test_padding_truncation_strictness_and_dtype_casts(tmp_path: Path, mesh: jax.sharding.Mesh,
                                                       ckptr: ocp.Checkpointer) -> None:
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    tree = {"x": sharded(x, mesh, "x"), "cast_on_save": sharded(x + 0.5, mesh, "x")}
    save_args = {"x": ocp.SaveArgs(), "cast_on_save": ocp.SaveArgs(dtype=jnp.bfloat16)}
    ckptr.save(tmp_path / "c", args=MithrilSave(tree, save_args=save_args))
    s = NamedSharding(mesh, P("x"))

    def restore(**kw: Any) -> Any:
        args = {"x": ocp.ArrayRestoreArgs(sharding=s, **kw)}
        return ckptr.restore(tmp_path / "c", args=MithrilRestore(
            {"x": 0}, restore_args=args, partial_restore=True))["x"]

    padded = restore(global_shape=(10, 4), strict=False)
    assert padded.shape == (10, 4)
    assert np.array_equal(np.asarray(padded), np.concatenate([x, np.zeros((2, 4), np.float32)]))
    assert np.array_equal(np.asarray(restore(global_shape=(4, 4), strict=False)), x[:4])
    with pytest.raises(ValueError, match="not compatible with the stored shape"):
        restore(global_shape=(4, 4))
    as_bf16 = restore(dtype=jnp.bfloat16)
    assert as_bf16.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(as_bf16), x.astype(jnp.bfloat16))
    out = ckptr.restore(tmp_path / "c")
    assert out["cast_on_save"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out["cast_on_save"]), (x + 0.5).astype(jnp.bfloat16))


def test_numpy_leaves_random_keys_and_jax_params_restored_as_numpy(
        tmp_path: Path, mesh: jax.sharding.Mesh, ckptr: ocp.Checkpointer) -> None:
    w = random_bits(jnp.bfloat16, (8, 4), 3)
    tree = {"w": sharded(w, mesh, "x", "y"), "table": random_bits(np.int16, (5, 3), 4),
            "key": jax.random.key(42)}
    ckptr.save(tmp_path / "c", args=MithrilSave(tree))
    out = ckptr.restore(tmp_path / "c")
    assert isinstance(out["table"], np.ndarray) and same_bits(out["table"], tree["table"])
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
    as_np = ckptr.restore(tmp_path / "c", args=MithrilRestore(
        {"w": 0}, restore_args={"w": ocp.RestoreArgs(restore_type=np.ndarray)},
        partial_restore=True))["w"]
    assert isinstance(as_np, np.ndarray) and same_bits(as_np, w)


def _flip_block(blob: Path, tensor_prefix: str) -> None:
    """Flip the last byte of the first block of the tensor whose name starts with the prefix."""
    data = bytearray(blob.read_bytes())
    info = MckpRangeReader(lambda o, n: bytes(data[o:o + n]), len(data)).open()
    ti = next(i for i, t in enumerate(info.tensors) if t.name.startswith(tensor_prefix))
    ref = info.index[(ti, 0)]
    data[ref.offset + ref.length - 1] ^= 0x10
    blob.write_bytes(bytes(data))


def test_damage_names_parameter_and_file_and_partial_restores_decode_only_what_they_need(
        tmp_path: Path, mesh: jax.sharding.Mesh, ckptr: ocp.Checkpointer) -> None:
    w = np.random.default_rng(5).standard_normal((64, 64), np.float32)
    tree = {"w": sharded(w, mesh, "x", "y"), "v": sharded(w + 1, mesh, "x")}
    ckptr.save(tmp_path / "c", args=MithrilSave(tree))
    (blob,) = blobs(tmp_path / "c")
    _flip_block(blob, "v[")
    with pytest.raises(ChecksumMismatch) as e:
        ckptr.restore(tmp_path / "c")
    assert "'v'" in str(e.value) and str(blob) in str(e.value)
    # the damaged param is never decoded when the restore does not ask for it
    want = abstract({"w": tree["w"]})
    out = ckptr.restore(tmp_path / "c", args=MithrilRestore(
        want, restore_args=ocp.checkpoint_utils.construct_restore_args(want),
        partial_restore=True))
    assert same_bits(out, {"w": tree["w"]})
    held = {"w": abstract(tree["w"]), "v": ocp.PLACEHOLDER}
    out = ckptr.restore(tmp_path / "c", args=MithrilRestore(held, restore_args={
        "w": ocp.ArrayRestoreArgs(sharding=tree["w"].sharding), "v": ocp.RestoreArgs()}))
    assert same_bits(out["w"], tree["w"]) and out["v"] is ocp.PLACEHOLDER


def test_checkpoint_manager_saves_async_after_the_host_copy(
        tmp_path: Path, mesh: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    release, writing = threading.Event(), threading.Event()
    original = th.write_blob

    def held(*args: Any, **kwargs: Any) -> str:
        writing.set()
        assert release.wait(60), "gate never released"
        return original(*args, **kwargs)

    monkeypatch.setattr(th, "write_blob", held)
    w = random_bits(jnp.bfloat16, (16, 8), 6)
    raw = np.zeros(64 + 16, np.float32)  # 64-byte aligned, so dlpack shares it (CPU)
    host = raw[(-raw.ctypes.data % 64) // 4:][:64]
    host[:] = np.arange(64)
    state = {"w": sharded(w, mesh, "x", "y"), "aliased": jnp.from_dlpack(host)}
    assert np.shares_memory(np.asarray(state["aliased"]), host)
    step = jax.jit(lambda x: x + 1, donate_argnums=0)
    mngr = ocp.CheckpointManager(tmp_path / "run")
    try:
        mngr.save(0, args=MithrilSave(state))  # returns while the blob write is held
        assert writing.wait(60)
        assert not (tmp_path / "run" / "0").exists()  # not committed
        assert not [p for p in (tmp_path / "run").rglob("*") if is_blob_name(p.name)]
        host[:] = -1.0  # the memory under a saved array changes ...
        nxt = step(state.pop("w"))  # ... and the caller donates a saved array's buffers
        release.set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
        out = mngr.restore(0, args=MithrilRestore())
        assert same_bits(out, {"aliased": np.arange(64, dtype=np.float32), "w": w})
        assert nxt.shape == (16, 8) and nxt.sharding == out["w"].sharding
    finally:
        release.set()
        mngr.close()


def test_manager_retention_and_composite_items(tmp_path: Path, mesh: jax.sharding.Mesh) -> None:
    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=opts) as mngr:
        for step in range(4):
            state = {"w": sharded(random_bits(jnp.bfloat16, (8, 8), step), mesh, "x")}
            mngr.save(step, args=ocp.args.Composite(
                state=MithrilSave(state), meta=ocp.args.JsonSave({"step": step})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["2", "3"]
        out = mngr.restore(3, args=ocp.args.Composite(
            state=MithrilRestore(), meta=ocp.args.JsonRestore()))
    assert out.meta == {"step": 3} and same_bits(out.state, state)
    assert blobs(tmp_path / "run" / "3" / "state")


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_checkpoints_written_by_orbax_still_load_and_stay_unchanged(
        tmp_path: Path, state: dict[str, Any], ckptr: ocp.Checkpointer) -> None:
    arrays = {"w": state["w"], "b": state["b"], "n": np.arange(5, dtype=np.int16)}
    theirs = ocp.StandardCheckpointer()
    theirs.save(tmp_path / "orbax", arrays)
    theirs.wait_until_finished()
    theirs.close()
    before = _hashes(tmp_path / "orbax")
    assert not blobs(tmp_path / "orbax")
    target = {"w": abstract(state["w"]), "b": abstract(state["b"]),
              "n": jax.ShapeDtypeStruct((5,), np.int16)}
    assert same_bits(ckptr.restore(tmp_path / "orbax", args=restore_args_for(target)), arrays)
    with pytest.warns(UserWarning, match="Sharding info not provided"):  # Orbax's, as ever
        assert same_bits(ckptr.restore(tmp_path / "orbax"), arrays)
    assert _hashes(tmp_path / "orbax") == before


def test_a_reader_without_our_handlers_is_told_the_type_is_unknown(
        tmp_path: Path, state: dict[str, Any], ckptr: ocp.Checkpointer) -> None:
    ckptr.save(tmp_path / "c", args=MithrilSave(state))
    with pytest.raises(ValueError, match=r"mithril_async\.jax\.Array") as e:
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(tmp_path / "c")
    assert "Unknown type" in str(e.value.__cause__)


def test_enable_globally_serves_standard_save(tmp_path: Path, state: dict[str, Any]) -> None:
    arrays = {"w": state["w"], "b": state["b"]}
    enable_globally(compression_level=5)
    try:
        c = ocp.StandardCheckpointer()
        c.save(tmp_path / "c", arrays)
        c.wait_until_finished()
        assert blobs(tmp_path / "c")
        assert same_bits(c.restore(tmp_path / "c", abstract(arrays)), arrays)
        c.close()
    finally:
        disable_globally()
    assert isinstance(ocp.type_handlers.get_type_handler(jax.Array), ocp.type_handlers.ArrayHandler)
    ours = ocp.Checkpointer(MithrilCheckpointHandler())
    assert same_bits(ours.restore(tmp_path / "c"), arrays)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="compression_level"):
        MithrilCheckpointHandler(compression_level=0)
    with pytest.raises(ConfigError, match="threads"):
        MithrilCheckpointHandler(threads=0)
    with pytest.raises(TypeError, match="type_handler_registry"):
        MithrilCheckpointHandler(type_handler_registry=ocp.type_handlers.create_type_handler_registry())


def test_two_processes_each_write_only_their_replica_0_shards(tmp_path: Path) -> None:
    """A real two-process jax.distributed job (2 CPU devices each, a 2x2 mesh across both):
    every process writes its own blob with its replica-0 shards only, and each restores its
    shards of other shardings bit-exact (checked in the workers)."""
    worker = Path(__file__).with_name("_orbax_worker.py")
    root = Path(__file__).resolve().parents[2]
    port_file = tmp_path / "coordinator.port"
    procs = [subprocess.Popen([sys.executable, str(worker), str(port_file), str(i),
                               str(tmp_path / "c")],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"process {i}: ok" in out, out[-3000:]
    names = [p.name for p in blobs(tmp_path / "c")]
    assert [n[:14] for n in names] == ["mithril-p00000", "mithril-p00001"]
    with SavedItem(str(tmp_path / "c")) as item:
        files = {k: sorted(Path(p.file).name[:14] for p in r.pieces)
                 for k, r in item.records.items()}
    assert files == {"w": ["mithril-p00000"] * 2 + ["mithril-p00001"] * 2,
                     "rows": ["mithril-p00000", "mithril-p00001"],
                     "rep": ["mithril-p00000"]}
