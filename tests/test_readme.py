"""The configuration reference (docs/CONFIG.md, linked from the README) is the real config:
it parses, names every key of every ``[checkpointing]`` table, and each value it sets is the
default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from mithril_async.config import CheckpointingConfig, parse_config

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def _reference() -> str:
    return REFERENCE.read_text(encoding="utf-8").split("```toml\n", 1)[1].split("```", 1)[0]


def _keys(model: type[BaseModel], prefix: str) -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        sub = next((a for a in getattr(field.annotation, "__args__", (field.annotation,))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        out |= _keys(sub, f"{prefix}{name}.") if sub is not None else {prefix + name}
    return out


def test_readme_config_reference_is_complete_and_shows_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MITHRIL_PROCESS", raising=False)  # the real defaults
    text = _reference()
    cfg = parse_config(text).checkpointing
    # every key appears, set or commented out
    mentioned = {line.lstrip("# ").split(" ", 1)[0] for line in text.splitlines()
                 if "=" in line and not line.startswith("[")}
    leaves = {k.rsplit(".", 1)[-1] for k in _keys(CheckpointingConfig, "")}
    assert leaves <= mentioned, sorted(leaves - mentioned)
    default = CheckpointingConfig()
    for table in ("compression", "pipeline", "lossy"):
        assert getattr(cfg, table) == getattr(default, table), table

    def top(c: Any) -> dict[str, Any]:
        return {k: v for k, v in c.model_dump().items()
                if k not in ("compression", "pipeline", "lossy", "remote")}

    assert top(cfg) == top(default)
