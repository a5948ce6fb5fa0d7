"""Fixtures of the CUDA tests: the manager tests' config factory."""

from tests.manager.conftest import make_config  # noqa: F401
