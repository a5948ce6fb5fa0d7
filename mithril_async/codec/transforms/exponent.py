"""EXP_BF16 (id 2) and EXP_FP32 (id 3): the 8-bit exponent of every float in its own plane.

bf16 ``S EEEEEEEE MMMMMMM`` -> planes ``[exponent, sign|mantissa7]``; fp32 -> ``[exponent,
sign|top-7-mantissa, mantissa byte 1, mantissa byte 0]`` (ZipNN style: the exponent plane
compresses to ~2.6 bits/byte, the mantissa planes are near random).  Layouts:
:mod:`~mithril_async.codec.kernels_ref` (``exp_group``) and ``docs/FORMAT.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mithril_async.codec import kernels as K
from mithril_async.codec.transforms.base import U8, ChunkTransform, Transform

if TYPE_CHECKING:
    from mithril_async.codec.dtypes import DtypeInfo
    from mithril_async.codec.params import CodecParams


class ExponentPlanes(ChunkTransform):
    """Exponent planes for the dtypes whose ``DtypeInfo.exp_kind`` is ``kind``."""

    def __init__(self, id: Transform, kind: str) -> None:
        self.id = id
        self.kind = kind  # the kernels' name of the layout ("bf16"/"fp32")
        width = K.KIND_WIDTHS[kind]
        self.widths = range(width, width + 1)
        self.native_kind = K.KIND_CODES[kind]

    def choose(self, info: DtypeInfo, size: int, params: CodecParams) -> int | None:
        if (params.byte_grouping and params.exponent_planes and info.exp_kind == self.kind
                and size >= 16):
            return info.itemsize
        return None

    def forward(self, src: U8, width: int, base: U8 | None, out: U8 | None,
                tally: K.NonFiniteTally | None = None) -> U8:
        return K.exp_group(src, self.kind, base, out=out, tally=tally)

    def inverse(self, planes: U8, width: int, base: U8 | None, out: U8) -> None:
        K.exp_ungroup(planes, self.kind, base, out=out)


EXP_BF16 = ExponentPlanes(Transform.EXP_BF16, "bf16")
EXP_FP32 = ExponentPlanes(Transform.EXP_FP32, "fp32")
