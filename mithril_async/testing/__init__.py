"""Test helpers shipped with the library, for users' own tests as much as for ours.

:mod:`mithril_async.testing.store` is the Store conformance suite (it imports pytest; nothing
in the library imports this package).
"""
