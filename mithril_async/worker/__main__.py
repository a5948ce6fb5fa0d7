"""``python -m mithril_async.worker --fd N``: a checkpoint worker serving the trainer at the
other end of the inherited socket ``N`` (started by the manager, not by hand)."""

from __future__ import annotations

import argparse

from mithril_async.worker.server import serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mithril_async.worker")
    parser.add_argument("--fd", type=int, required=True,
                        help="the inherited socket of the control channel")
    parser.add_argument("--nice", type=int, default=0,
                        help="added to the nice value (background_nice)")
    parser.add_argument("--trainer", type=int, default=None,
                        help="the training process's pid (default: the parent)")
    args = parser.parse_args()
    serve(args.fd, args.nice, args.trainer)


if __name__ == "__main__":
    main()
