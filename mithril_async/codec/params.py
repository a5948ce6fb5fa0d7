"""How tensors are encoded: :class:`CodecParams`, recorded verbatim in blob headers.

Its own module so that the chunk code and the transform objects it dispatches to
(:mod:`~mithril_async.codec.transforms`) can both import it without importing each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mithril_async.errors import ConfigError

__all__ = ["CodecParams", "MiB"]

MiB = 1 << 20


@dataclass(frozen=True)
class CodecParams:
    """How tensors are encoded; recorded verbatim in blob headers and manifests.

    ``level``: zstd level for planes coded with zstd.  ``byte_grouping``: group bytes of
    multi-byte elements.  ``exponent_planes``: for bf16/fp32, split out the 8-bit exponent
    (needs ``byte_grouping``).  ``chunk_bytes``: chunk size (the parallelism unit; rounded to
    the element size).  ``entropy``: ``"auto"`` picks a coder per plane (see
    :mod:`~mithril_async.codec.entropy`), ``"zstd"`` forces zstd (for comparisons).
    ``raw_bits``/``huff_min_bits``: sampled entropy thresholds (bits/byte) above which a
    float plane is stored raw / Huffman coded instead of zstd coded.
    """

    level: int = 3
    byte_grouping: bool = True
    exponent_planes: bool = True
    chunk_bytes: int = 4 * MiB
    entropy: str = "auto"
    raw_bits: float = 7.9
    huff_min_bits: float = 2.0

    def __post_init__(self) -> None:
        if not -7 <= self.level <= 22:
            raise ConfigError(f"level: zstd level {self.level} outside -7..22")
        if not 1 <= self.chunk_bytes <= 1 << 30:
            raise ConfigError(f"chunk_bytes: {self.chunk_bytes} outside 1..1 GiB")
        if self.entropy not in ("auto", "zstd"):
            raise ConfigError(f"entropy: {self.entropy!r} is not 'auto' or 'zstd'")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (for blob headers and manifests)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecParams:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (newer writers)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
