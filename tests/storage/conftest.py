"""Session-scoped S3 servers for the storage tests: moto (tests/s3_server.py) and a real Ceph
RGW (tests/rgw_server.py; its tests are skipped, saying why, where Ceph is not installed or
cannot start). ``s3_server`` is moto, for tests of other stores that only need some S3;
``tests/storage/test_s3.py`` runs against both through its own parametrised fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.rgw_server import CephRGW, RGWUnavailable, shared_rgw
from tests.s3_server import MotoS3, dummy_env


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(moto_server: MotoS3) -> MotoS3:
    return moto_server


@pytest.fixture(scope="session")
def rgw_server() -> Iterator[CephRGW]:
    with dummy_env():
        try:
            server = shared_rgw()
        except RGWUnavailable as exc:
            pytest.skip(f"Ceph RGW unavailable: {exc}")
        yield server
