"""Former name of :mod:`mithril_async.step_deltas`, kept so existing imports keep working.

``from mithril_async.delta import SparseDeltaRecorder`` (and the lazily imported
``SparseDeltaCallback``) give the very objects of :mod:`mithril_async.step_deltas`; new code
imports that package. The manager's delta chains are :mod:`mithril_async.save.delta_chain`.
"""

from __future__ import annotations

from typing import Any

from mithril_async import step_deltas as _step_deltas
from mithril_async.step_deltas import AnalysisReport as AnalysisReport
from mithril_async.step_deltas import SparseDeltaRecorder as SparseDeltaRecorder
from mithril_async.step_deltas import SparseLayerDelta as SparseLayerDelta
from mithril_async.step_deltas import StepSummary as StepSummary
from mithril_async.step_deltas import analyze_delta_dir as analyze_delta_dir
from mithril_async.step_deltas import compute_analysis as compute_analysis
from mithril_async.step_deltas import iter_deltas as iter_deltas
from mithril_async.step_deltas import load_sparse_delta as load_sparse_delta
from mithril_async.step_deltas import read_metadata as read_metadata
from mithril_async.step_deltas import reconstruct_weights_at_step as reconstruct_weights_at_step
from mithril_async.step_deltas import write_outputs as write_outputs

__all__ = _step_deltas.__all__


def __getattr__(name: str) -> Any:
    """Names :mod:`mithril_async.step_deltas` imports lazily (``SparseDeltaCallback``)."""
    if name in __all__:
        return getattr(_step_deltas, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
