"""The public API: what users import, catch and get back is exported from the package, and
nothing private is."""

from __future__ import annotations

import importlib

import pytest

import mithril_async
from mithril_async import errors


def test_every_exported_name_resolves_and_none_is_private() -> None:
    for name in mithril_async.__all__:
        assert getattr(mithril_async, name) is not None, name
        assert not name.startswith("_") or name == "__version__", name


def test_every_error_a_caller_may_catch_is_exported() -> None:
    raised = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert raised <= set(mithril_async.__all__), sorted(raised - set(mithril_async.__all__))


def test_what_a_restore_and_a_store_give_back_is_exported() -> None:
    for name in ("RestoreResult", "ResumeReport", "SaveResult", "SaveHandle", "Store",
                 "BlobWriter", "open_store"):
        assert name in mithril_async.__all__, name


@pytest.mark.parametrize(("old", "new", "name"), [
    ("mithril_async.pipeline.results", "mithril_async.save.results", "SaveResult"),
    ("mithril_async.pipeline.coordinator", "mithril_async.save.coordinator", "RankPart"),
])
def test_a_moved_module_still_imports_for_a_release_with_a_warning(
        old: str, new: str, name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}"):
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(importlib.import_module(new), name)


def test_the_tier_layer_class_keeps_its_old_name_for_a_release() -> None:
    from mithril_async.tiers import layer

    with pytest.warns(DeprecationWarning, match="Tiers is now TierLayer"):
        old = layer.Tiers
    assert old is layer.TierLayer
