"""Session-scoped moto S3 server for the storage tests (see tests/s3_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.s3_server import MotoS3


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    with MotoS3() as server:
        yield server
