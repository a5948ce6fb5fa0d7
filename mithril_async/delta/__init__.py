"""Delta checkpoints: sparse per-step deltas of training (seed 003), exact reconstruction at
any recorded step, and training-dynamics analysis.

The Hugging Face callback is imported lazily (``from mithril_async.delta import
SparseDeltaCallback``) so that ``transformers`` stays optional.
"""

from __future__ import annotations

from typing import Any

from mithril_async.delta.analysis import AnalysisReport, analyze_delta_dir
from mithril_async.delta.reconstruct import (
    iter_deltas,
    read_metadata,
    reconstruct_weights_at_step,
)
from mithril_async.delta.recorder import SparseDeltaRecorder, StepSummary
from mithril_async.delta.sparse import SparseLayerDelta, load_sparse_delta


def __getattr__(name: str) -> Any:
    if name == "SparseDeltaCallback":
        from mithril_async.delta.hf_callback import SparseDeltaCallback

        return SparseDeltaCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AnalysisReport",
    "SparseDeltaCallback",
    "SparseDeltaRecorder",
    "SparseLayerDelta",
    "StepSummary",
    "analyze_delta_dir",
    "iter_deltas",
    "load_sparse_delta",
    "read_metadata",
    "reconstruct_weights_at_step",
]
