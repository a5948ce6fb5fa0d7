"""The ``metadata.json`` of a sparse-delta directory and the per-step summary behind it.

Kept apart from the recorder so that readers (reconstruction, analysis, the CLI) do not import
the background pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

METADATA_KEY = "metadata.json"
BASE_KEY_STEM = "base"
METADATA_FORMAT = "mithril-sparse-delta"
METADATA_VERSION = 1


def delta_key(step: int, ext: str) -> str:
    return f"delta_{step:06d}{ext}"


#: file extension of delta and base blobs (MCKP container)
EXT = ".mckp"


@dataclass(frozen=True)
class StepSummary:
    """What :meth:`SparseDeltaRecorder.record` found for one step (also a metadata entry)."""

    step: int
    path: str
    timestamp: float
    nonzero: int
    total_params: int
    changed_layers: int
    update_l2: float
    diff_seconds: float
    blocked_seconds: float

    @property
    def sparsity(self) -> float:
        """Fraction of parameters that did not change (0.99 = 99% sparse)."""
        return 1.0 - self.nonzero / self.total_params if self.total_params else 1.0

    def entry(self, nbytes: int) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": self.path,
            "timestamp": self.timestamp,
            "sparsity": self.sparsity,
            "nonzero": self.nonzero,
            "changed_layers": self.changed_layers,
            "update_l2": self.update_l2,
            "bytes": nbytes,
        }


def build_metadata(
    *,
    dtype: torch.dtype,
    total_params: int,
    encoding: str,
    base: str | None,
    base_step: int | None,
    layers: Mapping[str, Mapping[str, Any]],
    checkpoints: list[dict[str, Any]],
) -> dict[str, Any]:
    """The ``metadata.json`` document: the recording's keys plus what readers need to
    verify.

    Recording keys: ``total_params``, ``dtype`` (``"torch.bfloat16"``), ``checkpoints`` (each with
    ``step``, ``path``, ``sparsity``, ``nonzero``, ``changed_layers``). Added: ``format`` and
    ``format_version`` (readers refuse unknown versions), ``encoding``, ``base`` (key of the
    starting snapshot or null), ``base_step``, ``layers`` (shape and numel of every tracked
    tensor, so analysis knows layer sizes without the base) and, per checkpoint,
    ``timestamp``, ``update_l2`` (L2 norm of new - old over all layers) and ``bytes``.
    """
    return {
        "format": METADATA_FORMAT,
        "format_version": METADATA_VERSION,
        "total_params": total_params,
        "dtype": str(dtype),
        "encoding": encoding,
        "base": base,
        "base_step": base_step,
        "num_layers": len(layers),
        "layers": {k: dict(v) for k, v in layers.items()},
        "checkpoints": list(checkpoints),
    }
