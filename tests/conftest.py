"""Suite-wide settings and fixtures.

- Hypothesis: no per-example deadline and no ``too_slow`` health check, layered on whatever
  profile is active: both measure the machine's speed, and a loaded 2-core CI box is slow
  (the fuzz tests' pytest timeout still catches a hang). ``HYPOTHESIS_PROFILE=default``
  keeps Hypothesis' own defaults.
- ``make_config``: the manager tests' config factory, for tests outside tests/manager that
  build a real manager (tests/pipeline, test_retention.py).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from tests.manager.conftest import make_config  # noqa: F401

if os.environ.get("HYPOTHESIS_PROFILE") != "default":
    settings.register_profile("mithril-no-timing", parent=settings.default, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("mithril-no-timing")
