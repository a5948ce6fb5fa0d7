"""The checkpoint worker: the background part of every save in a process of its own.

With ``[checkpointing.pipeline] process = "worker"`` (the default) the training process keeps
only the snapshot (staged in shared memory, :mod:`~mithril_async.worker.shm`) and a control channel
(:mod:`~mithril_async.worker.channel`); the worker (:mod:`~mithril_async.worker.server`,
started by :mod:`~mithril_async.worker.client`) encodes, writes, commits and applies
retention, so the training thread never shares the GIL with that work, and a save whose
snapshot was taken survives the training process's death.
"""
