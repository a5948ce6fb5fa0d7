"""Run by test_s3.py: ``python -m tests.faults._s3_child ENDPOINT BUCKET PREFIX``.

Commits step 1 to S3 (remote only), prints ``committed 1``, then starts step 2, whose upload
the parent's proxy keeps failing until it SIGKILLs this process mid-upload.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mithril_async import CheckpointManager
from mithril_async.storage.s3 import S3Store
from tests.faults._common import Counter, Net, make_config, metric, set_step

PART = 256 * 1024


def open_store(endpoint: str, bucket: str, prefix: str, attempts: int = 3) -> S3Store:
    return S3Store(bucket, prefix, endpoint_url=endpoint, region_name="us-east-1",
                   part_size=PART, min_part_size=PART, max_attempts=attempts, max_concurrency=4)


def main() -> None:
    endpoint, bucket, prefix = sys.argv[1:4]
    torch.set_num_threads(1)
    model, counter = Net(256), Counter()
    cfg = make_config(Path("/nonexistent/runs"), delta=False)
    store = open_store(endpoint, bucket, prefix, attempts=20)
    with CheckpointManager(cfg, {"model": model, "data": counter}, store=store,
                           runs_prefix="runs") as m:
        set_step(model, counter, 1)
        m.save_nowait(1, metrics={"loss": metric(1)}).result()
        print("committed 1", flush=True)
        set_step(model, counter, 2)
        m.save_nowait(2, metrics={"loss": metric(2)}).result()
        print("committed 2", flush=True)  # the parent kills us before this


if __name__ == "__main__":
    main()
