"""What every chunk transform provides, and the table of on-disk transform ids.

A transform rearranges the raw bytes of a chunk (XORed with a base first for a delta chunk)
into planes that the plane coders (:mod:`~mithril_async.codec.entropy`) compress well.  Its id
is the low 7 bits of the block header's transform byte (bit 7 is
:data:`~mithril_async.codec.chunk.DELTA_BIT`), so ids are part of the MCKP format: see
``docs/CODEC.md`` for how to add one.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from mithril_async.codec.dtypes import DtypeInfo
    from mithril_async.codec.kernels import NonFiniteTally
    from mithril_async.codec.params import CodecParams

__all__ = ["ChunkTransform", "Transform", "U8"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]


class Transform(IntEnum):
    """Every transform id ever allocated; the value is written into block headers.

    Append only: never renumber a member and never reuse a value, even of a transform that
    is no longer written (old blobs still carry it).  Values are below 0x80 (the delta bit).
    """

    NONE = 0
    GROUP = 1  # byte grouping, width = ChunkMeta.width
    EXP_BF16 = 2  # exponent plane + sign/mantissa plane (ZipNN style)
    EXP_FP32 = 3  # exponent plane + sign/7 mantissa bits + two low mantissa planes


class ChunkTransform:
    """One byte transform of a chunk: the writer's choice, the layout and its inverse.

    Subclasses set :attr:`id` and :attr:`widths` and implement :meth:`choose`,
    :meth:`forward` and :meth:`inverse`; everything runs once per chunk (the byte work is in
    the C kernels of :mod:`~mithril_async.codec.kernels`).
    """

    #: the on-disk id (a :class:`Transform` member)
    id: Transform
    #: widths a block header may carry for this transform (checked before decoding)
    widths: range
    #: the planes are the (XORed) chunk bytes themselves: without a base, the decoder decodes
    #: straight into the output and skips :meth:`inverse`
    identity: ClassVar[bool] = False
    #: how the native chunk decoder rebuilds the chunk from its planes (``kind`` of
    #: ``mk_ungroup_planes``; -1: the planes are the bytes); None: only :meth:`inverse` can
    native_kind: int | None = None

    @property
    def name(self) -> str:
        return self.id.name

    def choose(self, info: DtypeInfo, size: int, params: CodecParams) -> int | None:
        """The width to use on a chunk of ``size`` bytes of dtype ``info`` under ``params``,
        or ``None`` when the writer should not use this transform there."""
        raise NotImplementedError

    def planes(self, width: int) -> int:
        """How many equal planes ``width`` makes (a tail plane follows when the chunk is not
        a whole number of ``width``-byte elements)."""
        return width

    def forward(self, src: U8, width: int, base: U8 | None, out: U8 | None,
                tally: NonFiniteTally | None = None) -> U8:
        """The planes of ``src ^ base`` (``base`` may be ``None``), concatenated, in ``out``
        when given (an identity transform may return ``src`` itself). ``tally``: count the
        NaN/Inf elements of ``src`` into it, in the same pass (an identity transform that
        returns ``src`` reads nothing, and counts nothing)."""
        raise NotImplementedError

    def inverse(self, planes: U8, width: int, base: U8 | None, out: U8) -> None:
        """Rebuild the chunk from its concatenated ``planes`` into ``out`` (XOR ``base`` back
        when given)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<transform {self.id.value} {self.name}>"
