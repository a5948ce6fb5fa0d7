"""Sparse per-step deltas of training: a recorder that stores only the parameters
each optimizer step changed, exact reconstruction at any recorded step, and training-dynamics
analysis (:mod:`.analysis` computes, :mod:`.report` and :mod:`.plots` write).

Not the manager's delta chains (XOR deltas between checkpoint versions): those are part of the
save pipeline, :mod:`mithril_async.save.xor_chain`.

The Hugging Face callback is imported lazily (``from mithril_async.step_deltas import
SparseDeltaCallback``) so that ``transformers`` stays optional.
"""

from __future__ import annotations

from typing import Any

from mithril_async.step_deltas.analysis import AnalysisReport, compute_analysis
from mithril_async.step_deltas.reconstruct import (
    iter_deltas,
    read_metadata,
    reconstruct_weights_at_step,
)
from mithril_async.step_deltas.recorder import SparseDeltaRecorder, StepSummary
from mithril_async.step_deltas.report import analyze_delta_dir, write_outputs
from mithril_async.step_deltas.sparse import SparseLayerDelta, load_sparse_delta


def __getattr__(name: str) -> Any:
    if name == "SparseDeltaCallback":
        from mithril_async.step_deltas.hf_callback import SparseDeltaCallback

        return SparseDeltaCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AnalysisReport",
    "SparseDeltaCallback",
    "SparseDeltaRecorder",
    "SparseLayerDelta",
    "StepSummary",
    "analyze_delta_dir",
    "compute_analysis",
    "iter_deltas",
    "load_sparse_delta",
    "read_metadata",
    "reconstruct_weights_at_step",
    "write_outputs",
]
