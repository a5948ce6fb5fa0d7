"""Restores: which live tensors a version is decoded into, and how.

:mod:`~mithril_async.restore.targets` decides where decoded bytes may go: straight into a
live tensor only when that tensor provably *is* the live state.
"""
