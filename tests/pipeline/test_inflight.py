"""The encode window: chunks in flight between the codec threads and the store are bounded by
two per codec thread (and by ``max_inflight_mib``), whatever the blob's size."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from mithril_async import CheckpointManager, TensorDict, parse_config
from mithril_async.codec.chunk import CodecParams
from mithril_async.save import chunks, writers


def test_window_is_two_chunks_per_thread_capped_by_config(tmp_path: Path,
                                                          monkeypatch: Any) -> None:
    cfg = parse_config(f'[checkpointing]\nruns_path = "{tmp_path}/runs"\nrun_id = "r"\n'
                       "[checkpointing.compression]\nthreads = 2\nchunk_mib = 1\n"
                       "auto_chunk = false\n")
    live = TensorDict({"w": torch.randn(12 << 18)})  # 12 MiB: 12 chunks of 1 MiB
    state = {"in_flight": 0, "peak": 0}
    lock = threading.Lock()
    real_encode, real_write = chunks.encode_chunk, writers.BlobEncoder._run_chunks

    def encode(*a: Any, **kw: Any) -> Any:
        with lock:
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
        return real_encode(*a, **kw)

    async def run_chunks(self: Any, jobs: Any, views: Any, bases: Any, entries: Any,
                         params: Any, sink: Any) -> None:
        async def counted(ti: int, ci: int, enc: Any) -> None:
            await sink(ti, ci, enc)
            with lock:
                state["in_flight"] -= 1

        await real_write(self, jobs, views, bases, entries, params, counted)

    monkeypatch.setattr(chunks, "encode_chunk", encode)
    monkeypatch.setattr(writers.BlobEncoder, "_run_chunks", run_chunks)
    with CheckpointManager(cfg, {"model": live}) as m:
        budget = m._ctx.encoder.budget
        params = CodecParams(chunk_bytes=1 << 20)
        assert budget.inflight_limit(params) == 4 << 20  # max(4, 2 x 2 threads) chunks
        want = live.tensors["w"].clone()
        m.save_nowait(1).result()
        assert 1 <= state["peak"] <= 4
        live.tensors["w"].zero_()
        budget.pipe = budget.pipe.model_copy(update={"max_inflight_mib": 8})
        assert budget.inflight_limit(CodecParams(chunk_bytes=4 << 20)) == 8 << 20  # the cap
        m.restore_sync(1)
    assert torch.equal(live.tensors["w"], want)  # 12 chunks through a 4-chunk window
