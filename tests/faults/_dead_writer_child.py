"""A writer to be SIGKILLed mid-save: commits step 1, then starts step 2 and stops dead at
its first blob commit, with that blob written out in full as a temp file.

    python _dead_writer_child.py RUNS READY

Writes the temp file's path to READY once it stands there, then waits to be killed. The
run keeps ``orphan_age_s`` at its default (600 s), so only the dead-writer rules can remove
what it leaves within the test.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from mithril_async import CheckpointManager, parse_config
from mithril_async.storage.local import LocalWriter


def config_text(runs: str) -> str:
    """No delta chains, compression on, the default orphan age."""
    return (f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "run1"\nckpting_save_iter = 1\n'
            f"keep_last = 3\n[checkpointing.compression]\nthreads = 1\n")


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1024, 1024, generator=g)}  # 4 MiB: written to its temp file


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1024, 1024))

    def set_step(self, step: int) -> None:
        with torch.no_grad():
            self.w.copy_(state(step)["w"])


def main() -> None:
    runs, ready = sys.argv[1], Path(sys.argv[2])
    model = Model()
    mgr = CheckpointManager(parse_config(config_text(runs)), {"model": model})
    model.set_step(1)
    mgr.save_nowait(1).result()

    async def stop_dead(self: LocalWriter, *_: Any) -> int:
        await self._in_thread("flush", lambda: self._flush(None))  # every byte in the temp
        # written aside and renamed: the test polls for the name, so the name must appear
        # only with its content (a plain write_text let the test read an empty file)
        aside = ready.with_name(ready.name + ".part")
        aside.write_text(str(self._tmp))
        os.replace(aside, ready)
        threading.Event().wait()  # hangs the loop thread: nothing else of the save moves
        return 0

    LocalWriter.commit = stop_dead  # type: ignore[method-assign]
    model.set_step(2)
    mgr.save_nowait(2)
    asyncio.run(asyncio.sleep(3600))  # the main thread waits to be killed


if __name__ == "__main__":
    main()
