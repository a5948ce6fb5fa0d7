"""pytest configuration for Orbax's own test files, as run by ``run_orbax_suite.sh``.

What Orbax's test harness expects and its wheel does not ship, in every mode:
- absl flags marked parsed (as the wheel's own ``orbax/checkpoint/conftest.py`` does);
- a JAX distributed client: ``MultiProcessTest.setUp`` waits at a barrier of the
  ``jax.distributed`` service, so a one-process ``jax.distributed.initialize`` runs first
  (with a long heartbeat timeout);
- ``orbax.checkpoint._src.testing.multiprocess_test`` and its ``oss`` twin (in Orbax's
  repository, not in the wheel): the runner copies them beside this file as
  ``_multiprocess_test.py`` / ``_oss_multiprocess_test.py`` and they are registered under their
  package names here.

``MITHRIL_ORBAX_GLOBAL=1``: our handlers become Orbax's global ``jax.Array`` / ``np.ndarray``
type handlers (``enable_globally``) before any test module is imported.

In every mode the run ends with a line counting the blobs our handlers wrote and the params
they restored (zero in the control run), so a count of passes is known to be ours.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _register(name: str, path: Path) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


COUNTS = {"blobs written": 0, "params restored": 0}


def _count(module: Any, name: str, key: str, per_call: Any) -> None:
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        COUNTS[key] += per_call(args, out)
        return out

    setattr(module, name, counted)


def pytest_configure(config: Any) -> None:
    del config
    import jax
    import portpicker
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    # a generous heartbeat: on a loaded machine the default 100 s can lapse and abort the run
    jax.distributed.initialize(f"localhost:{portpicker.pick_unused_port()}", num_processes=1,
                               process_id=0, heartbeat_timeout_seconds=900)
    _register("orbax.checkpoint._src.testing.oss.multiprocess_test",
              HERE / "_oss_multiprocess_test.py")
    _register("orbax.checkpoint._src.testing.multiprocess_test", HERE / "_multiprocess_test.py")
    from mithril_async.integrations.orbax import arrays, type_handlers

    _count(type_handlers, "write_blob", "blobs written", lambda a, out: 1)
    _count(arrays, "restore_jax", "params restored", lambda a, out: len(out))
    _count(arrays, "restore_numpy", "params restored", lambda a, out: len(out))
    if os.environ.get("MITHRIL_ORBAX_GLOBAL") == "1":
        from mithril_async.integrations.orbax import enable_globally

        enable_globally()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        "mithril_async handlers: " + ", ".join(f"{v} {k}" for k, v in COUNTS.items()))
