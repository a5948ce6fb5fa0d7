#!/usr/bin/env bash
# PyTorch DCP's own checkpoint tests with mithril_async's planners as DCP's defaults.
# Not part of the test suite (minutes on 2 cores). Results: docs/suites/dcp.md.
#
#   benchmarks/suites/run_dcp_suite.sh PYTORCH_REPO [REF] [OUT_DIR]
#
# PYTORCH_REPO: a git checkout of pytorch/pytorch (a shallow or sparse clone of
# test/distributed/checkpoint is enough: git clone --depth 1 --filter=blob:none --sparse
# https://github.com/pytorch/pytorch && git -C pytorch sparse-checkout set test/distributed/checkpoint;
# a bare or mirror git directory works too) and REF the commit or tag whose tests run (default
# HEAD); the files are taken from test/distributed/checkpoint/ at REF. A missing repository or
# ref stops the run with a message naming it. Files: test_format_utils.py,
# test_file_system_checkpoint_cpu.py, test_dtensor_resharding.py, e2e/test_e2e_save_and_load.py.
# Their harness needs `expecttest`
# (not a project dependency): install it apart, e.g.
#   .venv/bin/python -m pip install --target /tmp/dcp_suite/site expecttest
# and pass that folder in SUITE_SITE (default /tmp/dcp_suite/site).
# Each file runs in three modes (dcp_site/sitecustomize.py): default (DCP's planners, the
# control), mithril (ours as the defaults), mithril-all (ours, every tensor compressed).
# GPU-gated tests run on CPU gloo ranks (MITHRIL_DCP_SUITE_CPU_RANKS=1, at most 4 ranks);
# torch.compile variants are deselected (inductor on 2 cores: far too slow for this run).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/_peer_repo.sh"
ref="${2:-HEAD}"
torch_repo="$(peer_git_dir pytorch/pytorch "${1:-}" "$ref")" || exit 2
out="${3:-/tmp/dcp_suite/out}"
tests="${WORK:-/tmp/dcp_suite/tests}"
site="${SUITE_SITE:-/tmp/dcp_suite/site}"
py="${PYTHON:-$repo/.venv/bin/python}"
per_file_s="${PER_FILE_S:-1200}"
modes="${MODES:-default mithril mithril-all}"
files="${FILES:-test_format_utils.py test_file_system_checkpoint_cpu.py test_dtensor_resharding.py e2e/test_e2e_save_and_load.py}"
rm -rf "$tests" && mkdir -p "$tests" "$out"
git --git-dir="$torch_repo" archive "$ref" test/distributed/checkpoint \
  | tar -x -C "$tests" --strip-components=3 || exit 1
echo "DCP tests from $1 at $(git --git-dir="$torch_repo" rev-parse "$ref")" | tee "$out/source.txt"
for mode in $modes; do
  for f in $files; do
    name="$(basename "$f" .py)"
    echo "== $mode $f"
    ( cd "$tests" && \
      MITHRIL_DCP_SUITE_MODE="$mode" MITHRIL_DCP_SUITE_CPU_RANKS=1 OMP_NUM_THREADS=1 \
      PYTHONPATH="$here/dcp_site:$site:$repo${PYTHONPATH:+:$PYTHONPATH}" \
      timeout "$per_file_s" "$py" -m pytest -q -p no:cacheprovider -k "not compile_True" \
        --junitxml="$out/$mode-$name.xml" "$f" > "$out/$mode-$name.log" 2>&1 )
    echo "   exit $? ($(tail -1 "$out/$mode-$name.log"))"
  done
done
"$py" "$here/dcp_suite_report.py" "$out"
