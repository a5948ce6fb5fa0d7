"""Deprecated: moved to :mod:`mithril_async.save.coordinator` (a save's own). Importing a name from
here still works for a release, with a DeprecationWarning."""

from mithril_async.moved import forward_to

__getattr__ = forward_to(__name__, "mithril_async.save.coordinator")
