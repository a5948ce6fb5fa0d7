"""What every model of the on-disk metadata shares: frozen, no unknown field, keys checked.

The manifest (:mod:`mithril_async.manifest`) and its piece layouts
(:mod:`mithril_async.manifest_pieces`) are built on these.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from mithril_async.storage.base import check_key


class Model(BaseModel):
    """A metadata model: frozen, and an unknown field is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Keyed(Model):
    """A model naming a store key (repo-root relative, checked)."""

    key: str

    @field_validator("key")
    @classmethod
    def _safe_key(cls, v: str) -> str:
        return check_key(v)


def falsy(v: Any) -> bool:
    """``exclude_if``: an empty or false field is left out of the JSON."""
    return not v


def none(v: Any) -> bool:
    """``exclude_if``: a None field is left out of the JSON."""
    return v is None
