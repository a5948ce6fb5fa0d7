"""The saver's encode stage batches small chunks (issue 21): a run of chunks of <= 64 KiB is
one pool task and one native call, the blob stays byte for byte what chunk-by-chunk coding
writes, and a batch never holds more than one chunk's worth of bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mithril_async import CheckpointManager, TensorDict, parse_config
from mithril_async.codec.chunk import BATCH_CHUNK_BYTES
from mithril_async.save import chunks, writers
from mithril_async.save.chunks import batch_jobs


def _jobs(sizes: list[int]) -> list[tuple[int, int, int, int]]:
    return [(i, 0, 0, n) for i, n in enumerate(sizes)]


def test_batches_runs_of_small_chunks_in_order() -> None:
    small, big = 10_000, BATCH_CHUNK_BYTES + 1
    sizes = [small] * 5 + [big] + [small] * 200 + [BATCH_CHUNK_BYTES] * 20 + [big, big]
    got = batch_jobs(_jobs(sizes), 4 << 20)
    assert [j for b in got for j in b] == _jobs(sizes)  # every chunk once, in order
    for b in got:
        n = sum(j[3] for j in b)
        assert len(b) == 1 or all(j[3] <= BATCH_CHUNK_BYTES for j in b)
        assert n <= 16 * BATCH_CHUNK_BYTES or len(b) == 1
    assert [len(b) for b in got[:2]] == [5, 1]  # the run before the big chunk, then it alone
    assert len(got) < len(sizes) // 5  # 225 small chunks in a few batches
    # never more than one chunk's bytes in a batch: it takes the budget one chunk does
    assert all(sum(j[3] for j in b) <= 100_000 for b in batch_jobs(_jobs(sizes), 100_000)
               if len(b) > 1)


def _cfg(root: Path, extra: str = "") -> Any:
    return parse_config(f'[checkpointing]\nruns_path = "{root}"\nrun_id = "r"\n'
                        "[checkpointing.compression]\nthreads = 1\n" + extra)


def _state() -> TensorDict:
    g = torch.Generator().manual_seed(3)
    t: dict[str, torch.Tensor] = {}
    for i in range(150):  # norms, biases, step counters: many tiny tensors
        t[f"l{i}.norm"] = torch.randn(64 + i, generator=g).to(torch.bfloat16)
        t[f"l{i}.bias"] = torch.randn(300, generator=g)
        t[f"l{i}.step"] = torch.tensor(float(i))
    t["embed"] = torch.randn(300_000, generator=g)  # one big tensor over several chunks
    t["ids"] = torch.arange(20_000)  # not a float: coded on its own
    return TensorDict(t)


def test_blob_is_the_chunk_by_chunk_blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """One codec thread: chunks complete in order, so both blobs can be compared."""
    calls = {"batches": 0}
    real = chunks.encode_chunks

    def counted(items: Any, params: Any) -> Any:
        calls["batches"] += 1
        return real(items, params)

    monkeypatch.setattr(chunks, "encode_chunks", counted)
    out = []
    for sub, batching in (("batched", True), ("single", False)):
        with monkeypatch.context() as m:
            if not batching:
                m.setattr(writers, "batch_jobs", lambda jobs, cap: [[j] for j in jobs])
            live = _state()
            with CheckpointManager(_cfg(tmp_path / sub), {"model": live}) as mgr:
                assert mgr.save_nowait(1).result().status == "committed"
                if batching:
                    assert 0 < calls["batches"] < 60  # 452 tensors, ~450 of them tiny
                    batches_seen = calls["batches"]
                else:
                    assert calls["batches"] == batches_seen  # none more without batching
                want = {k: v.clone() for k, v in live.tensors.items()}
                for v in live.tensors.values():
                    v.zero_()
                assert mgr.restore_sync(1) == 1
                assert all(torch.equal(live.tensors[k], w) for k, w in want.items())
        out.append((tmp_path / sub / "r/versions/v000001/model.mckp").read_bytes())
    assert out[0] == out[1]


def test_batches_under_a_budget_that_fits_the_staging(tmp_path: Path) -> None:
    """A host budget the staged path fits in: batches take budget as chunks do, and the
    save neither streams nor exceeds it."""
    live = _state()
    with CheckpointManager(_cfg(tmp_path, "[checkpointing.pipeline]\nhost_memory_mib = 256\n"),
                           {"model": live}) as mgr:
        res = mgr.save_nowait(1).result()
        assert res.status == "committed" and not res.streamed
        assert 0 < res.host_peak_bytes <= 256 << 20
