"""NONE (id 0): the chunk bytes as one plane (every dtype; the writer's fallback)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mithril_async.codec import kernels as K
from mithril_async.codec.transforms.base import U8, ChunkTransform, Transform

if TYPE_CHECKING:
    from mithril_async.codec.dtypes import DtypeInfo
    from mithril_async.codec.params import CodecParams


class NoTransform(ChunkTransform):
    id = Transform.NONE
    widths = range(1, 2)
    identity = True
    native_kind = -1

    def choose(self, info: DtypeInfo, size: int, params: CodecParams) -> int | None:
        return 1

    def planes(self, width: int) -> int:
        return 1

    def forward(self, src: U8, width: int, base: U8 | None, out: U8 | None,
                tally: K.NonFiniteTally | None = None) -> U8:
        return src if base is None else K.xor(src, base, out=out, tally=tally)

    def inverse(self, planes: U8, width: int, base: U8 | None, out: U8) -> None:
        if base is None:
            np.copyto(out, planes)
        else:
            K.xor(planes, base, out=out)


NONE = NoTransform()
