"""The public API: what users import, catch and get back is exported from the package, and
nothing private is."""

from __future__ import annotations

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
