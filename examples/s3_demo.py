"""The demo training loop against S3: starts a loopback S3 server, runs, stops it.

A real S3-compatible server (moto's ``ThreadedMotoServer``) is started on 127.0.0.1 with dummy
credentials; ``configs/train.toml`` gets a ``[checkpointing.remote]`` table pointing at it
(``mode = "mirror"``: every version on local disk and in the bucket, same keys); the demo
trains, saves in the background, resumes; then the bucket's objects are listed and the server
is stopped.

    python examples/s3_demo.py [--steps 30] [--mode mirror|remote_only]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", choices=("mirror", "remote_only"), default="mirror")
    args = ap.parse_args(argv)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    import boto3
    import train_loop
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no per-request access log
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    print(f"S3 server on {endpoint} (moto, loopback only)")
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="mithril-demo")
        toml = (ROOT / "configs" / "train.toml").read_text() + (
            f'\n[checkpointing.remote]\nbucket = "mithril-demo"\nprefix = "demo"\n'
            f'endpoint_url = "{endpoint}"\nregion_name = "us-east-1"\nmode = "{args.mode}"\n')
        with tempfile.TemporaryDirectory(prefix="mithril-s3-demo-") as tmp:
            cfg = Path(tmp) / "train_s3.toml"
            cfg.write_text(toml)
            rc = train_loop.main(["--config", str(cfg), "--steps", str(args.steps),
                                  "--runs", tmp])
        keys = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(
            Bucket="mithril-demo") for o in p.get("Contents", [])]
        manifests = [k for k in keys if k.endswith("manifest.json")]
        print(f"bucket holds {len(keys)} objects; committed versions: "
              f"{', '.join(k.split('/')[-2] for k in manifests)}")
        return rc if manifests else 1
    finally:
        server.stop()
        print("S3 server stopped")


if __name__ == "__main__":
    raise SystemExit(main())
