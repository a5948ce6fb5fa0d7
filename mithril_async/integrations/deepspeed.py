"""DeepSpeed checkpoint engine writing compressed files (minimal).

    engine, *_ = deepspeed.initialize(...)
    engine.checkpoint_engine = MithrilCheckpointEngine()
    engine.save_checkpoint(save_dir)             # files at DeepSpeed's own paths, compressed
    engine.load_checkpoint(save_dir)

Why a ``CheckpointEngine``: DeepSpeed names every file (model states, ZeRO optimizer
partitions per rank) and calls ``save(state_dict, path)`` for each, then ``commit(info)``
before it writes the ``latest`` tag file. This engine compresses each file (tensors as one
MCKP blob, the rest as a JSON skeleton) on a background thread so the files of one tag encode
in parallel, and ``commit`` waits for all of them, so ``latest`` never names a tag whose files
are not durable; a failed write is raised by ``commit``. DeepSpeed states hold Python objects
(loss scalers, config objects) that DeepSpeed itself pickles, so those leaves are pickled here
too (``pickle_fallback``) and unpickled on load, as ``torch.load(weights_only=False)`` would.
Plain DeepSpeed (``torch.save``) files still load, pickle allowed: the engine trusts a
checkpoint folder exactly as far as DeepSpeed itself does (loading an untrusted one runs its
author's code either way; the Lightning plugin, by contrast, unpickles only when asked).
DeepSpeed is not part of the dev
environment: ``tests/integrations/test_deepspeed.py`` runs where it is installed and skips
elsewhere (docs/integrations/deepspeed.md says how it was run).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from mithril_async.codec.chunk import CodecParams
from mithril_async.errors import SaveFailed
from mithril_async.integrations.lightning import load_checkpoint_file, save_checkpoint_file

__all__ = ["MithrilCheckpointEngine"]


class MithrilCheckpointEngine(CheckpointEngine):
    """Compressed DeepSpeed checkpoint files; ``commit`` makes a tag durable."""

    def __init__(self, config_params: Any = None, *, compression_level: int = 3,
                 threads: int = 2) -> None:
        super().__init__(config_params)
        self.name = "MithrilCheckpointEngine"
        self.params = CodecParams(level=compression_level)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "mithril-deepspeed")
        self._pending: list[tuple[str, concurrent.futures.Future[int]]] = []

    def create(self, info: Any) -> None:
        """A new tag begins; leftovers of an earlier one must have been committed."""
        self._drain()

    def save(self, state_dict: Any, path: str) -> None:
        # DeepSpeed does not change the state until commit(), so no snapshot copy is needed
        self._pending.append((path, self._pool.submit(
            save_checkpoint_file, state_dict, path, params=self.params, threads=1,
            pickle_fallback=True, fmt="deepspeed")))

    def load(self, path: str, map_location: Any = None) -> Any:
        self._drain()
        return load_checkpoint_file(path, map_location, allow_pickle=True)

    def commit(self, info: Any) -> bool:
        """Wait until every file of the tag is durable; raise the first failure."""
        self._drain()
        return True

    def preserves_storage_sharing(self) -> bool:
        """Views are stored by their own bytes, so DeepSpeed need not clone them first."""
        return False

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def cleanup(self) -> None:
        try:
            self._drain()
        finally:
            self._pool.shutdown(wait=True)

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        errors: list[tuple[str, BaseException]] = []
        for path, fut in pending:
            try:
                fut.result()
            except BaseException as exc:
                errors.append((path, exc))
        if errors:
            first_path, first = errors[0]
            raise SaveFailed(f"checkpoint write to {first_path} failed ({len(errors)} file(s) "
                             f"failed): {first}") from first
