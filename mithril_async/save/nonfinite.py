"""The non-finite guard of a save: which tensors hold NaN or Inf, which of those the run
allows, and what that does to the version (``[checkpointing] nonfinite``).

The counting itself happens where the bytes are read anyway: the codec's transforms count
each chunk's elements as they rearrange them (:class:`~mithril_async.codec.kernels.
NonFiniteTally`), an uncompressed blob's pieces are counted as they are hashed, the lossy
tier's tensors before they are quantised. Each blob's counts go into its
:class:`~mithril_async.manifest.BlobRef` (``nonfinite``: ``"<item>/<tensor>"`` -> NaNs,
Infs), so every rank's counts reach rank 0 in its part, and rank 0 decides for the whole
version: ``"hold"`` commits it as held (no alias moves to it), ``"fail"`` commits nothing
(:class:`~mithril_async.errors.NonFiniteState`), ``"allow"`` only records.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from mithril_async.codec import kernels as K
from mithril_async.codec.dtypes import tensor_bytes
from mithril_async.errors import NonFiniteState
from mithril_async.manifest import BlobRef, NonFinite, merge_nonfinite

if TYPE_CHECKING:
    import torch

__all__ = ["Counts", "blocking", "count_tensors", "describe", "failure", "mark_allowed",
           "named"]

#: per tensor: (NaNs, Infs)
Counts = dict[str, tuple[int, int]]


def named(item: str, counts: Mapping[str, Sequence[int]]) -> dict[str, NonFinite]:
    """The tensors of ``item`` that hold any NaN or Inf, as ``"<item>/<tensor>"`` ->
    :class:`NonFinite` (tensors without any are left out)."""
    return {f"{item}/{name}": NonFinite(nan=int(c[0]), inf=int(c[1]))
            for name, c in counts.items() if c[0] or c[1]}


def count_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, NonFinite]:
    """NaN / Inf counts of CPU tensors by name, for bytes no transform reads (the lossy
    tier's input, before it is quantised); tensors without any are left out."""
    out: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        view, dtype, _ = tensor_bytes(t, where=name)
        tally = K.NonFiniteTally.of(dtype)
        if tally is not None and view.size:
            K.count_nonfinite(view, tally)
            out[name] = (tally.nan, tally.inf)
    return {name: NonFinite(nan=n, inf=i) for name, (n, i) in out.items() if n or i}


def mark_allowed(counts: Mapping[str, NonFinite], globs: Iterable[str]
                 ) -> dict[str, NonFinite]:
    """``counts`` with each tensor matching one of the ``"<item>/<tensor>"`` ``globs``
    (fnmatch, case-sensitive) marked allowed."""
    pats = list(globs)
    return {name: c.model_copy(update={"allowed": any(fnmatch.fnmatchcase(name, p)
                                                      for p in pats)})
            for name, c in counts.items()}


def blocking(blobs: Iterable[BlobRef]) -> Counts:
    """The tensors of ``blobs`` (one version, every rank) holding NaN / Inf that are not
    allowed, with their counts summed over the blobs holding a piece of them."""
    merged = merge_nonfinite(b.nonfinite for b in blobs)
    return {name: (c.nan, c.inf) for name, c in sorted(merged.items()) if not c.allowed}


def describe(tensors: Mapping[str, Sequence[int]], limit: int = 8) -> str:
    """``item model, tensor fc.weight: 3 NaN, 0 Inf; ...`` (the first ``limit``)."""
    parts = []
    for full, (nan, inf) in list(tensors.items())[:limit]:
        item, _, tensor = full.partition("/")
        parts.append(f"item {item}, tensor {tensor}: {nan} NaN, {inf} Inf")
    more = len(tensors) - limit
    return "; ".join(parts) + (f"; and {more} more tensor(s)" if more > 0 else "")


def failure(step: int, tensors: Counts) -> NonFiniteState:
    """The error of a save that ``nonfinite = "fail"`` refuses."""
    return NonFiniteState(f"save of step {step} holds NaN/Inf ({describe(tensors)}); "
                          'nonfinite = "fail": nothing was committed', tensors)
