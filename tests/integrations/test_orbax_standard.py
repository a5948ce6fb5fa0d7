"""Orbax's ``StandardSave`` / ``StandardRestore`` idiom over our codec: a restore lands on the
shardings of the target tree (another mesh shape, another device count, a single device), as
with Orbax's own standard handler, through ``MithrilStandardSave`` / ``MithrilStandardRestore``
and through ``MithrilRestore`` given only a target tree.

Real jax + orbax-checkpoint on the CPU with 8 virtual devices (``_orbax_env``); the
other-device-count case also in a fresh process that has only 3 devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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

from mithril_async.integrations.orbax import (
    MithrilCheckpointHandler,
    MithrilRestore,
    MithrilSave,
    MithrilStandardCheckpointHandler,
    MithrilStandardRestore,
    MithrilStandardSave,
)
from mithril_async.integrations.orbax.layout import is_blob_name
from tests.integrations._orbax_env import devices  # sets XLA_FLAGS

ROOT = Path(__file__).resolve().parent.parent.parent


def _values() -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((8, 16)).astype(jnp.bfloat16),
            "b": rng.standard_normal(8).astype(np.float32)}


def _saved_state() -> dict[str, jax.Array]:
    mesh = jax.make_mesh((2, 2), ("x", "y"), devices=devices()[:4])
    v = _values()
    return {"w": jax.device_put(v["w"], NamedSharding(mesh, P("x", "y"))),
            "b": jax.device_put(v["b"], NamedSharding(mesh, P("x")))}


def _targets() -> list[tuple[str, dict[str, Any]]]:
    """Target trees whose shardings differ from the saved 2x2 mesh over devices 0-3."""
    wide = jax.make_mesh((2, 4), ("a", "b"), devices=devices())  # 8 devices, other shape
    pair = jax.make_mesh((2,), ("a",), devices=devices()[6:8])  # 2 devices, none saved on
    v = _values()

    def sds(name: str, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(v[name].shape, v[name].dtype, sharding=sharding)

    return [
        ("wide", {"w": sds("w", NamedSharding(wide, P("b", "a"))),
                  "b": sds("b", NamedSharding(wide, P("b")))}),
        ("pair", {"w": sds("w", NamedSharding(pair, P(None, "a"))),
                  "b": sds("b", NamedSharding(pair, P()))}),
        ("single", {"w": sds("w", SingleDeviceSharding(devices()[5])),
                    "b": sds("b", SingleDeviceSharding(devices()[7]))}),
    ]


def _check(out: dict[str, Any], target: dict[str, Any]) -> None:
    v = _values()
    for name, want in target.items():
        assert out[name].sharding == want.sharding, name
        got = np.asarray(out[name])
        assert got.dtype == v[name].dtype and got.tobytes() == v[name].tobytes(), name


@pytest.mark.parametrize("name,target", _targets(), ids=[n for n, _ in _targets()])
def test_standard_restore_lands_on_the_target_shardings(name: str, target: dict[str, Any],
                                                        tmp_path: Path) -> None:
    with ocp.Checkpointer(MithrilStandardCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "c", args=MithrilStandardSave(_saved_state()))
        assert [p for p in (tmp_path / "c").iterdir() if is_blob_name(p.name)]  # our files
        _check(ckptr.restore(tmp_path / "c", args=MithrilStandardRestore(target)), target)


@pytest.mark.parametrize("name,target", _targets(), ids=[n for n, _ in _targets()])
def test_mithril_restore_of_a_target_tree_honours_its_shardings(
        name: str, target: dict[str, Any], tmp_path: Path) -> None:
    with ocp.Checkpointer(MithrilCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "c", args=MithrilSave(_saved_state()))
        _check(ckptr.restore(tmp_path / "c", args=MithrilRestore(target)), target)


def test_a_leaf_without_a_sharding_gets_the_saved_one(tmp_path: Path) -> None:
    saved = _saved_state()
    target = {"w": jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),
              "b": jax.ShapeDtypeStruct((8,), np.float32,
                                        sharding=SingleDeviceSharding(devices()[3]))}
    with ocp.Checkpointer(MithrilStandardCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "c", args=MithrilStandardSave(saved))
        out = ckptr.restore(tmp_path / "c", args=MithrilStandardRestore(target))
    assert out["w"].sharding == saved["w"].sharding
    assert out["b"].sharding == target["b"].sharding
    assert np.asarray(out["w"]).tobytes() == _values()["w"].tobytes()


def test_a_checkpoint_manager_takes_the_standard_args_without_a_registry(
        tmp_path: Path) -> None:
    target = dict(_targets())["wide"]
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(3, args=MithrilStandardSave(_saved_state()))
        mngr.wait_until_finished()
        _check(mngr.restore(3, args=MithrilStandardRestore(target)), target)
    assert [p for p in (tmp_path / "run" / "3").rglob("*") if is_blob_name(p.name)]


def test_a_process_with_fewer_devices_restores_onto_its_own_mesh(tmp_path: Path) -> None:
    """Saved on four devices of this process; restored in a fresh process that has three,
    onto a mesh of all three, sharding the first dimension of an array of 12 rows."""
    rows = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    mesh = jax.make_mesh((4,), ("x",), devices=devices()[:4])
    with ocp.Checkpointer(MithrilStandardCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "c", args=MithrilStandardSave(
            {"rows": jax.device_put(rows, NamedSharding(mesh, P("x")))}))
    script = textwrap.dedent(f"""
        import numpy as np, jax, orbax.checkpoint as ocp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from mithril_async.integrations.orbax import (
            MithrilStandardCheckpointHandler, MithrilStandardRestore)
        assert len(jax.devices()) == 3
        mesh = jax.make_mesh((3,), ("x",))
        want = {{"rows": jax.ShapeDtypeStruct((12, 4), np.float32,
                                             sharding=NamedSharding(mesh, P("x")))}}
        with ocp.Checkpointer(MithrilStandardCheckpointHandler()) as ckptr:
            out = ckptr.restore({str(tmp_path / "c")!r}, args=MithrilStandardRestore(want))
        assert out["rows"].sharding == want["rows"].sharding
        assert len(out["rows"].addressable_shards) == 3
        np.save({str(tmp_path / "out.npy")!r}, np.asarray(out["rows"]))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert np.array_equal(np.load(tmp_path / "out.npy"), rows)
