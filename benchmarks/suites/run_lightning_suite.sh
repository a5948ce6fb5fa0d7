#!/usr/bin/env bash
# Lightning's own checkpointing tests (tag 2.6.5) with MithrilCheckpointIO as the strategy's
# default CheckpointIO. Not part of the test suite; results go in docs/suites/lightning.md.
#
#   benchmarks/suites/run_lightning_suite.sh LIGHTNING_REPO [lightning|sync|async] [pytest args...]
#
# lightning: Lightning's own TorchCheckpointIO (the baseline); sync: MithrilCheckpointIO
# (pickle_fallback=True, since the IO it stands in for pickles whole dicts); async: the same
# with asynchronous=True. LIGHTNING_REPO: a git checkout of Lightning-AI/pytorch-lightning
# (git clone https://github.com/Lightning-AI/pytorch-lightning; a bare or mirror git directory
# works too) holding the tag LIGHTNING_TAG (default 2.6.5, the one docs/suites/lightning.md
# reports); a missing repository or tag stops the run with a message naming it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
. "$ROOT/benchmarks/suites/_peer_repo.sh"
TAG="${LIGHTNING_TAG:-2.6.5}"
REPO="$(peer_git_dir Lightning-AI/pytorch-lightning "${1:-}" "$TAG")" || exit 2
shift
MODE="${1:-sync}"; shift || true
PY="${PY:-$ROOT/.venv/bin/python}"
WORK="${WORK:-/tmp/lightning-suite-$TAG}"
DEPS="${DEPS:-/tmp/lightning-suite-deps}"  # test-only deps, kept out of the project venv
if [ ! -d "$DEPS/jsonargparse" ]; then
    "$PY" -m pip install -q --target "$DEPS" "jsonargparse[signatures]"
    rm -rf "$DEPS"/typing_extensions*  # never shadow the venv's own
fi
rm -rf "$WORK" && mkdir -p "$WORK"
git --git-dir="$REPO" archive "$TAG" tests/tests_pytorch/__init__.py tests/tests_pytorch/conftest.py \
    tests/tests_pytorch/helpers tests/tests_pytorch/checkpointing/__init__.py \
    tests/tests_pytorch/checkpointing/test_model_checkpoint.py \
    tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py \
    tests/tests_pytorch/checkpointing/test_trainer_checkpoint.py \
    tests/tests_pytorch/checkpointing/test_torch_saving.py \
    tests/tests_pytorch/plugins/__init__.py tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py \
    | tar -x -C "$WORK"
# the swap: every strategy that builds its default IO builds ours instead
cat >> "$WORK/tests/tests_pytorch/conftest.py" <<PYEOF


# ---- added by mithril_async benchmarks/suites/run_lightning_suite.sh
import os as _os
if _os.environ.get("MITHRIL_IO", "lightning") != "lightning":
    import lightning.pytorch.strategies.strategy as _strategy_mod
    from mithril_async.integrations.lightning import MithrilCheckpointIO as _M

    def _default_io():
        return _M(pickle_fallback=True, asynchronous=_os.environ["MITHRIL_IO"] == "async")

    _strategy_mod.TorchCheckpointIO = _default_io
PYEOF
cd "$WORK/tests"
MITHRIL_IO="$MODE" PYTHONPATH="$ROOT:$WORK/tests:$DEPS" "$PY" -m pytest -p no:cacheprovider -q -rfE \
    --rootdir="$WORK/tests" tests_pytorch/checkpointing/test_model_checkpoint.py \
    tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py \
    tests_pytorch/checkpointing/test_trainer_checkpoint.py \
    tests_pytorch/checkpointing/test_torch_saving.py \
    tests_pytorch/plugins/test_checkpoint_io_plugin.py "$@"
