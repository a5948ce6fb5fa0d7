"""Remote stores for the one-process tier tests: one that counts (and records) its requests,
one that holds the uploads of one version until the test lets them through."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from mithril_async.storage.memory import MemoryStore


class CountingMemory(MemoryStore):
    """A MemoryStore that counts its operations by name (GETs, HEADs, LISTs...) and records
    every ``(operation, key)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.calls: list[tuple[str, str]] = []

    async def _step(self, op: str, key: str) -> None:
        self.ops[op] += 1
        self.calls.append((op, key))
        await super()._step(op, key)

    def reads(self) -> int:
        return self.ops["get"] + self.ops["get_range"] + self.ops["get_with_etag"]


class GatedRemote(MemoryStore):
    """Holds every upload of ``version``'s files until ``gate`` opens (an upload in flight)."""

    def __init__(self, version: str = "v000001") -> None:
        super().__init__()
        self.version = version
        self.gate = threading.Event()
        self.waiting = threading.Event()

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if f"/{self.version}/" in key:
            self.waiting.set()
            await asyncio.to_thread(self.gate.wait, 60)
        await super().put_if_absent(key, data)
