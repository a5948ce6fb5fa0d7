#!/usr/bin/env bash
# torchtitan's own checkpoint-manager unit tests (tests/unit_tests/test_checkpoint.py at
# TORCHTITAN_REF, default 2e92be1c4: the last revision whose tests import against the
# torchtitan 0.3.0 wheel) run against torchtitan's DCP manager (the baseline) or against
# MithrilCheckpointManager. Not part of the test suite; results go in docs/suites/torchtitan.md.
#
#   benchmarks/suites/run_torchtitan_suite.sh TORCHTITAN_REPO [dcp|mithril] [pytest args...]
#
# TORCHTITAN_REPO: a git checkout of pytorch/torchtitan (git clone
# https://github.com/pytorch/torchtitan; a bare or mirror git directory works too) holding
# TORCHTITAN_REF; a missing repository or ref stops the run with a message naming it.
# mithril: the test file's `CheckpointManager` is torchtitan_site/_mithril_shim.py's, which
# builds ours from the DCP Config (the same constructor, every shared field).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
. "$ROOT/benchmarks/suites/_peer_repo.sh"
REF="${TORCHTITAN_REF:-2e92be1c4}"
REPO="$(peer_git_dir pytorch/torchtitan "${1:-}" "$REF")" || exit 2
shift
MODE="${1:-mithril}"; shift || true
PY="${PY:-$ROOT/.venv/bin/python}"
WORK="${WORK:-/tmp/torchtitan-suite-$REF}"
if [ "$MODE" != "dcp" ] && [ "$MODE" != "mithril" ]; then
    echo "error: mode must be dcp or mithril, not $MODE" >&2
    exit 2
fi
rm -rf "$WORK" && mkdir -p "$WORK"
if ! git --git-dir="$REPO" show "$REF:tests/unit_tests/test_checkpoint.py" \
        > "$WORK/test_checkpoint.py" 2>/dev/null; then
    echo "error: $REF of pytorch/torchtitan has no tests/unit_tests/test_checkpoint.py" >&2
    exit 2
fi
if [ "$MODE" = "mithril" ]; then
    cp "$ROOT/benchmarks/suites/torchtitan_site/_mithril_shim.py" "$WORK/"
    sed -i 's/^from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager$/from torchtitan.components.checkpointer.dcp import AsyncMode\nfrom _mithril_shim import CheckpointManager/' \
        "$WORK/test_checkpoint.py"
    grep -q "^from _mithril_shim import CheckpointManager" "$WORK/test_checkpoint.py" || {
        echo "error: $REF's test_checkpoint.py does not import CheckpointManager as expected" >&2
        exit 2; }
fi
cd "$WORK"
MITHRIL_PROCESS=inline PYTHONPATH="$ROOT:$WORK" "$PY" -m pytest -p no:cacheprovider -q -rfE \
    --rootdir="$WORK" test_checkpoint.py "$@"
