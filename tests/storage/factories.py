"""Store factories of the storage tests (see :class:`mithril_async.testing.store.StoreFactory`),
shared by the test module of each store and by the mirror's, which combines them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import aioboto3

from mithril_async.storage.local import LocalStore
from mithril_async.storage.s3 import S3Store
from tests.s3_server import SMALL_PART, S3Server


@dataclass
class LocalFactory:
    root: Path
    spill_size: int = 1 << 20  # LocalWriter buffers this much before creating the temp file
    knows_upload_age: bool = True
    large_size: int = 12 << 20

    def new(self) -> LocalStore:
        return LocalStore(self.root)


_SESSION = aioboto3.Session()  # shared: building a botocore session per store is slow


@dataclass
class S3Factory:
    server: S3Server
    prefix: str
    endpoint_url: str = ""
    part_size: int = SMALL_PART
    max_concurrency: int = 4
    max_attempts: int = 3
    options: dict[str, object] = field(default_factory=dict)

    @property
    def knows_upload_age(self) -> bool:
        """moto reports every upload as initiated in 2010; RGW tells the real time."""
        return self.server.kind != "moto"

    @property
    def spill_size(self) -> int:
        return self.part_size

    @property
    def large_size(self) -> int:
        return 12 * self.part_size + 12_345

    def new(self) -> S3Store:
        return S3Store(
            self.server.bucket,
            self.prefix,
            endpoint_url=self.endpoint_url or self.server.endpoint_url,
            region_name="us-east-1",
            part_size=self.part_size,
            max_concurrency=self.max_concurrency,
            max_attempts=self.max_attempts,
            session=_SESSION,
            **{"min_part_size": SMALL_PART, **self.options},  # type: ignore[arg-type]
        )
