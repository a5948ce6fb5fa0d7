"""The chunk transforms, keyed by their on-disk id (see ``docs/CODEC.md``).

:data:`REGISTRY` is what :mod:`~mithril_async.codec.chunk` (encode, decode, plane sizes,
validation) and :mod:`~mithril_async.codec.container` (block validation) dispatch on; an id not
in it is an unknown transform (``InvalidFormat``).  :data:`CHOICE_ORDER` is the order in which
the writer offers a chunk to the transforms: the first whose ``choose`` returns a width wins.
"""

from __future__ import annotations

from mithril_async.codec.transforms.base import ChunkTransform, Transform
from mithril_async.codec.transforms.exponent import EXP_BF16, EXP_FP32
from mithril_async.codec.transforms.group import GROUP
from mithril_async.codec.transforms.none import NONE

__all__ = ["CHOICE_ORDER", "REGISTRY", "ChunkTransform", "Transform"]

#: Every transform a reader decodes, most specific first (NONE, which takes anything, last).
CHOICE_ORDER: tuple[ChunkTransform, ...] = (EXP_BF16, EXP_FP32, GROUP, NONE)

#: Transform by on-disk id (the low 7 bits of a block header's transform byte).
REGISTRY: dict[int, ChunkTransform] = {int(t.id): t for t in CHOICE_ORDER}

if len(REGISTRY) != len(CHOICE_ORDER) or not all(0 <= i < 0x80 for i in REGISTRY):
    raise ImportError(f"transform ids must be distinct and below 0x80: {CHOICE_ORDER}")
