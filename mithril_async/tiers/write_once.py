"""Objects of a version are written once on a tier: never replaced by other bytes.

A version number names one version on every tier. A job that reuses a number another
incarnation of the run already used (a fresh node folder with a fixed ``run_id``, say) must not
overwrite that version's objects: the old version would become unrestorable, and the new one
would be mixed with the old version's manifest. So every object of a version is created with
the store's conditional write (``put_if_absent``; S3 ``If-None-Match: *``, emulated where the
server lacks it). An object already present with the same bytes is accepted: a retried PUT
whose first answer was lost, or a manifest the node's own commit already wrote. Anything else is
a conflict, raised as :class:`~mithril_async.errors.KeyExists` naming the key and the tier.
"""

from __future__ import annotations

from mithril_async.errors import KeyExists, KeyNotFound
from mithril_async.storage.base import Store


async def put_once(store: Store, key: str, data: bytes | memoryview, tier: str) -> None:
    """Create ``key`` with ``data`` unless the same bytes are there already; another object
    under ``key`` raises :class:`KeyExists` (the tier keeps it untouched)."""
    for _ in range(2):
        try:
            await store.put_if_absent(key, data)
            return
        except KeyExists:
            pass
        try:
            existing = await store.get(key)
        except KeyNotFound:  # deleted in between (retention): try the conditional write again
            continue
        if existing == data:
            return
        break
    raise KeyExists(f"tier {tier}: {key} already holds another object (a version under this "
                    "number was written before, by another job or another incarnation of "
                    "this run); it is left as it is")
