"""What a blob's metadata says beyond its tensors, for the writers and the readers of blobs.

Every lossless blob (MCKP or safetensors) carries the state tree's non-tensor skeleton
(:data:`SKELETON_KEY`), the name of the item it holds (:data:`ITEM_KEY`) and, for tensors
stored only by reference to an earlier version's blob, where their full copy lives
(:data:`REFS_KEY`, :class:`TensorRef`). The save side writes them
(:mod:`mithril_async.save.writers`); the restore side reads them (:mod:`mithril_async.restore`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mithril_async.errors import InvalidFormat
from mithril_async.manifest import BaseRef

SKELETON_KEY = "mithril.skeleton"
ITEM_KEY = "mithril.item"
REFS_KEY = "mithril.refs"


@dataclass(frozen=True)
class TensorRef:
    """Where a full copy of a tensor lives: tensor ``name`` inside blob ``holder``."""

    holder: BaseRef
    name: str
    xxh64: int  # of the tensor's raw bytes

    def to_json(self) -> dict[str, Any]:
        return {"version_id": self.holder.version_id, "key": self.holder.key,
                "blob_xxh64": self.holder.xxh64, "name": self.name,
                "xxh64": f"{self.xxh64:016x}"}

    @classmethod
    def from_json(cls, d: Any, where: str) -> TensorRef:
        try:
            return cls(BaseRef(version_id=d["version_id"], key=d["key"], xxh64=d["blob_xxh64"]),
                       str(d["name"]), int(d["xxh64"], 16))
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidFormat(f"{where}: malformed tensor reference ({err})") from None


def skeleton_of(metadata: dict[str, Any], where: str) -> Any:
    """The state skeleton a blob's metadata records (``InvalidFormat`` if absent or not JSON)."""
    raw = metadata.get(SKELETON_KEY)
    if not isinstance(raw, str):
        raise InvalidFormat(f"{where}: blob has no state skeleton")
    try:
        return json.loads(raw)
    except ValueError as err:
        raise InvalidFormat(f"{where}: state skeleton is not JSON ({err})") from None

