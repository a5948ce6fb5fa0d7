"""Suite-wide settings and fixtures.

- Hypothesis: no per-example deadline and no ``too_slow`` health check, layered on whatever
  profile is active: both measure the machine's speed, and a loaded 2-core CI box is slow
  (the fuzz tests' pytest timeout still catches a hang). ``HYPOTHESIS_PROFILE=default``
  keeps Hypothesis' own defaults.
- ``make_config``: the manager tests' config factory, for tests outside tests/manager that
  build a real manager (tests/pipeline, test_retention.py).
- ``MITHRIL_PROCESS=inline`` (unless set already): saves run in the test process by default,
  so that each of the suite's many managers does not start a worker process. The worker is
  tested where a test asks for it by the key (tests/worker, the manager suites parametrized
  over both modes); tests/test_readme.py runs the README's commands with the real default.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("MITHRIL_PROCESS", "inline")

from tests.manager.conftest import make_config  # noqa: F401

if os.environ.get("HYPOTHESIS_PROFILE") != "default":
    settings.register_profile("mithril-no-timing", parent=settings.default, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("mithril-no-timing")
