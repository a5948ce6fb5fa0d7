"""GROUP (id 1): byte grouping, plane ``k`` holds byte ``k`` of every ``width``-byte element.

The writer uses it for every multi-byte dtype without an exponent transform (complex dtypes
group by their component width).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mithril_async.codec import kernels as K
from mithril_async.codec.transforms.base import U8, ChunkTransform, Transform

if TYPE_CHECKING:
    from mithril_async.codec.dtypes import DtypeInfo
    from mithril_async.codec.params import CodecParams


class ByteGroup(ChunkTransform):
    id = Transform.GROUP
    widths = range(2, K.MAX_WIDTH + 1)
    native_kind = 0

    def choose(self, info: DtypeInfo, size: int, params: CodecParams) -> int | None:
        w = info.group_width
        return w if params.byte_grouping and w > 1 and size >= 2 * w else None

    def forward(self, src: U8, width: int, base: U8 | None, out: U8 | None,
                tally: K.NonFiniteTally | None = None) -> U8:
        if base is None:
            return K.group(src, width, out=out, tally=tally)
        return K.xor_group(src, base, width, out=out, tally=tally)

    def inverse(self, planes: U8, width: int, base: U8 | None, out: U8) -> None:
        if base is None:
            K.ungroup(planes, width, out=out)
        else:
            K.ungroup_xor(planes, base, width, out=out)


GROUP = ByteGroup()
