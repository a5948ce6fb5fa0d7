"""What the Orbax integration writes into an item's folder, and the box arithmetic of shards.

No JAX here: this module is the on-disk contract, checked like any file we read.

Files: each process writes, per save of an item, one MCKP blob named
``mithril-p<process>-<random>.mckp`` into the item's folder (the one Orbax gives its type
handlers, beside Orbax's own ``_METADATA``). A blob holds that process's replica-0 shards;
its header's ``metadata["orbax"]`` is the index of what it holds::

    {"layout": 1, "process": 0,
     "params": [{"name": "params.w", "kind": "jax", "shape": [8, 4], "dtype": "bfloat16",
                 "sharding": "<Orbax's serialized sharding>" | null,
                 "key_impl": "<PRNG key implementation>" | null,
                 "pieces": [{"tensor": "params.w[0:4,0:4]", "box": [[0, 4], [0, 4]]}]}]}

A piece is one saved shard: the blob tensor ``tensor`` holds the global array's ``box``
(``[start, stop)`` per axis). Every process's blob lists the params it holds pieces of; the
reader merges them and checks that the pieces of each param are inside its shape, never
overlap, and cover it exactly, so a restore can never return an element nobody saved.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from mithril_async.codec.container import MckpInfo
from mithril_async.codec.dtypes import DTYPES
from mithril_async.errors import InvalidFormat

__all__ = [
    "INDEX_KEY",
    "KINDS",
    "LAYOUT",
    "Box",
    "Piece",
    "ParamRecord",
    "blob_name",
    "box_from_index",
    "box_shape",
    "check_coverage",
    "intersect",
    "is_blob_name",
    "merge_index",
    "piece_tensor_name",
    "volume",
]

#: the version of the index layout; readers refuse others
LAYOUT = 1
#: the key of the index in an MCKP header's metadata
INDEX_KEY = "orbax"
#: how a param was saved: a jax.Array (sharded) or a numpy array (whole, by process 0)
KINDS = ("jax", "numpy")

Box = tuple[tuple[int, int], ...]

_BLOB = re.compile(r"^mithril-p(\d{5,})-[0-9a-f]{16}\.mckp$")


def blob_name(process: int) -> str:
    """A fresh blob name for ``process`` (random: several saves may add to one folder)."""
    return f"mithril-p{process:05d}-{secrets.token_hex(8)}.mckp"


def is_blob_name(name: str) -> bool:
    return _BLOB.match(name) is not None


def volume(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_from_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """The box of a JAX shard index (a tuple of unit-step slices) in an array of ``shape``."""
    out = []
    for sl, n in zip(index, shape, strict=True):
        lo, hi, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"shard index {index} has a step other than 1")
        out.append((lo, max(lo, hi)))
    return tuple(out)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def piece_tensor_name(param: str, box: Box) -> str:
    """The blob tensor name of one piece: the param's name and its box, so every error
    about the tensor names the parameter."""
    return f"{param}[{','.join(f'{lo}:{hi}' for lo, hi in box)}]"


@dataclass(frozen=True)
class Piece:
    """One saved shard: tensor ``tensor`` of blob file ``file`` holds ``box`` of the param
    (``file`` is empty for a piece not written yet)."""

    file: str
    tensor: str
    box: Box


@dataclass
class ParamRecord:
    """Everything the blobs of one item say about one param (pieces from every process)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str | None
    key_impl: str | None
    pieces: list[Piece] = field(default_factory=list)

    def same_array(self, other: ParamRecord) -> bool:
        return (self.kind, self.shape, self.dtype, self.sharding, self.key_impl) == (
            other.kind, other.shape, other.dtype, other.sharding, other.key_impl)

    def index_entry(self) -> dict[str, Any]:
        """This param's entry of a blob's index (the JSON :func:`merge_index` reads back)."""
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape),
                "dtype": self.dtype, "sharding": self.sharding, "key_impl": self.key_impl,
                "pieces": [{"tensor": p.tensor, "box": [list(r) for r in p.box]}
                           for p in self.pieces]}


def _bad(file: str, what: str) -> InvalidFormat:
    return InvalidFormat(f"{file}: Orbax index: {what}")


def _int_list(v: Any, file: str, what: str) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise _bad(file, f"{what} is not a list of non-negative integers")
    return v


def _opt_str(v: Any, file: str, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _bad(file, f"{what} is not a string")
    return v


def _parse_param(d: Any, file: str, info: MckpInfo) -> ParamRecord:
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise _bad(file, "a param entry without a name")
    name = d["name"]
    kind, dtype = d.get("kind"), d.get("dtype")
    if kind not in KINDS:
        raise _bad(file, f"param {name!r}: unknown kind {kind!r}")
    if dtype not in DTYPES:
        raise _bad(file, f"param {name!r}: unknown dtype {dtype!r}")
    shape = tuple(_int_list(d.get("shape"), file, f"param {name!r} shape"))
    rec = ParamRecord(name, kind, shape, dtype,
                      _opt_str(d.get("sharding"), file, f"param {name!r} sharding"),
                      _opt_str(d.get("key_impl"), file, f"param {name!r} key_impl"))
    tensors = {t.name: t for t in info.tensors}
    pieces = d.get("pieces")
    if not isinstance(pieces, list):
        raise _bad(file, f"param {name!r}: pieces is not a list")
    for p in pieces:
        if not isinstance(p, dict) or not isinstance(p.get("tensor"), str):
            raise _bad(file, f"param {name!r}: a piece without a tensor name")
        raw = p.get("box")
        if not isinstance(raw, list) or len(raw) != len(shape):
            raise _bad(file, f"param {name!r}: a piece box of the wrong rank")
        box = tuple(tuple(_int_list(r, file, f"param {name!r} box")) for r in raw)
        if any(len(r) != 2 or not 0 <= r[0] <= r[1] <= n for r, n in zip(box, shape, strict=True)):
            raise _bad(file, f"param {name!r}: piece box {raw} is not inside shape {list(shape)}")
        entry = tensors.get(p["tensor"])
        if entry is None:
            raise _bad(file, f"param {name!r}: piece tensor {p['tensor']!r} is not in the blob")
        if entry.dtype != dtype or entry.shape != box_shape(box):  # type: ignore[arg-type]
            raise _bad(file, f"param {name!r}: tensor {entry.name!r} is {entry.dtype}"
                             f"{list(entry.shape)}, the index says {dtype}{list(box_shape(box))}")  # type: ignore[arg-type]
        rec.pieces.append(Piece(file, entry.name, box))  # type: ignore[arg-type]
    return rec


def merge_index(records: dict[str, ParamRecord], file: str, info: MckpInfo) -> None:
    """Add the index of blob ``file`` (parsed header ``info``) to ``records``."""
    index = info.metadata.get(INDEX_KEY)
    if not isinstance(index, dict) or index.get("layout") != LAYOUT:
        got = index.get("layout") if isinstance(index, dict) else None
        raise _bad(file, f"layout {got!r} (this reader knows {LAYOUT})")
    params = index.get("params")
    if not isinstance(params, list):
        raise _bad(file, "params is not a list")
    for d in params:
        rec = _parse_param(d, file, info)
        have = records.get(rec.name)
        if have is None:
            records[rec.name] = rec
        elif not have.same_array(rec):
            raise _bad(file, f"param {rec.name!r} is described differently by another blob")
        else:
            have.pieces.extend(rec.pieces)


def check_coverage(rec: ParamRecord) -> None:
    """Raise unless ``rec``'s pieces cover its shape exactly once (no gap, no overlap)."""
    pieces = rec.pieces
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if intersect(a.box, b.box) is not None:
                raise InvalidFormat(f"param {rec.name!r}: pieces {a.tensor!r} ({a.file}) and "
                                    f"{b.tensor!r} ({b.file}) overlap")
    have = sum(volume(box_shape(p.box)) for p in pieces)
    want = volume(rec.shape)
    if have != want:
        raise InvalidFormat(f"param {rec.name!r}: the blobs hold {have} of its {want} elements "
                            "(a process's blob is missing)")
