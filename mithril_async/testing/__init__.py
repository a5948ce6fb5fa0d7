"""Test helpers shipped with the library, for users' own tests as much as for ours.

:mod:`mithril_async.testing.store` is the Store conformance suite (it imports pytest).
Many ranks of one job in one process: :mod:`~mithril_async.testing.ranks` (a coordinator per
simulated rank, the save protocol's collectives in memory), :mod:`~mithril_async.testing.counting`
(a store that counts requests by kind, prefix and rank) and :mod:`~mithril_async.testing.sharded`
(FSDP2-like sharded state of one simulated rank). Nothing in the library imports this package.
"""
