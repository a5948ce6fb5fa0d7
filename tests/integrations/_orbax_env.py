"""JAX for the Orbax tests: CPU only, with 8 virtual devices.

Imported by each Orbax test module at collection. The device count is read when JAX first
creates its CPU backend (the first ``jax.devices()``, not ``import jax``), so setting the flag
here is early enough in a pytest process where no test has run yet; :func:`devices` fails
loudly if something created the backend earlier with fewer devices.
"""

from __future__ import annotations

import os

DEVICES = 8

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402


def devices() -> list[jax.Device]:
    got = jax.devices()
    assert len(got) >= DEVICES, (
        f"JAX has {len(got)} devices, the Orbax tests need {DEVICES}: something in this "
        "process created JAX's CPU backend before tests/integrations/_orbax_env.py set XLA_FLAGS")
    return got[:DEVICES]
