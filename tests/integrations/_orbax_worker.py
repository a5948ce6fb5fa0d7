"""One process of a two-process JAX job (``jax.distributed`` on the CPU, 2 devices each)
saving and restoring through ``MithrilCheckpointHandler`` into a shared folder.

    python _orbax_worker.py PORT_FILE PROCESS_ID FOLDER

Process 0 picks a free port for the ``jax.distributed`` coordinator and binds it at once,
naming it in PORT_FILE (renamed into place); process 1 waits for that file. Picking the port
in the parent, seconds before a child can bind it, would let another program take it.

Each process builds the same global arrays over a 2x2 mesh spanning both processes, saves
them, restores them into other shardings and checks every addressable shard against the
values it was built from (exit status 0 when all match).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def coordinator_port(port_file: Path, pid: int) -> int:
    if pid == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(port_file)
        return port
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"process 0 never wrote {port_file}")
        time.sleep(0.05)
    return int(port_file.read_text())


def main() -> None:
    port_file, pid, folder = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    port = coordinator_port(port_file, pid)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mithril_async.integrations.orbax import (
        MithrilCheckpointHandler,
        MithrilRestore,
        MithrilSave,
    )

    assert jax.process_count() == 2 and len(jax.devices()) == 4
    mesh = jax.make_mesh((2, 2), ("x", "y"))
    full = {"w": (np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 3).astype(jax.numpy.bfloat16),
            "rep": np.arange(10, dtype=np.int32), "rows": np.arange(16, dtype=np.float32)}
    specs = {"w": P("x", "y"), "rep": P(), "rows": P("x")}

    def build(specs: dict[str, P]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_callback(full[k].shape, NamedSharding(mesh, s),
                                                lambda idx, k=k: full[k][idx])
                for k, s in specs.items()}

    ckptr = ocp.Checkpointer(MithrilCheckpointHandler())
    ckptr.save(folder, args=MithrilSave(build(specs)))
    other = {"w": P("y", "x"), "rep": P("x"), "rows": P()}
    target = {k: jax.ShapeDtypeStruct(full[k].shape, full[k].dtype,
                                      sharding=NamedSharding(mesh, s)) for k, s in other.items()}
    for args in (MithrilRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(
            target)), MithrilRestore()):
        out = ckptr.restore(folder, args=args)
        for k, arr in out.items():
            for shard in arr.addressable_shards:
                got = np.asarray(shard.data)
                assert np.array_equal(got.view(np.uint8), full[k][shard.index].view(np.uint8)), k
    ckptr.close()
    print(f"process {pid}: ok", flush=True)


if __name__ == "__main__":
    main()
