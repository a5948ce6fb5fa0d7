#!/usr/bin/env bash
# Orbax's own checkpointing tests, with Orbax's handlers (the control) and with ours.
# Not part of the test suite (15-30 minutes on 2 cores). Results: docs/suites/orbax.md.
#
#   benchmarks/suites/run_orbax_suite.sh ORBAX_REPO [REF] [OUT_DIR]
#
# ORBAX_REPO: a git checkout of google/orbax (git clone https://github.com/google/orbax; a bare
# or mirror git directory works too); REF: the commit, tag or branch whose tests run (default
# HEAD; docs/suites/orbax.md names the one its results came from). A missing repository or ref
# stops the run with a message naming it. Test files taken from it: standard_checkpoint_handler_test.py,
# pytree_checkpoint_handler_test.py, checkpoint_manager_test.py and the multiprocess_test.py
# helpers the wheel lacks. Their other test dependencies (flax, optax, chex, portpicker, ...)
# are installed apart, into DEPS (default build/orbax-suite-deps), so the project venv keeps
# only what the project needs. Modes (MODES, default "orbax mithril"):
#   orbax    the three files as they are (Orbax's handlers)
#   mithril  orbax_site/test_mithril_standard.py (the standard handler's test base over our
#            pytree handler), orbax_site/test_mithril_pytree.py (the pytree test class with its
#            ocdbt_checkpoint_handler building MithrilCheckpointHandler), and
#            checkpoint_manager_test.py with our type handlers registered globally
# MITHRIL_SRC: where mithril_async is imported from (default this checkout; give an export of a
# commit with its native extensions built, e.g. `git archive HEAD | tar -x -C DIR && (cd DIR &&
# python setup.py build_ext --inplace)`, to test a fixed codec while others edit this tree).
# FILES (default "standard pytree manager") picks files. Every run: JAX_PLATFORMS=cpu, 8 virtual CPU devices, a fresh TEST_TMPDIR, TEST_SRCDIR with
# the repository's checkpoint/orbax/checkpoint/testing data, one-process jax.distributed
# (orbax_site/conftest.py).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/_peer_repo.sh"
ref="${2:-HEAD}"
orbax_repo="$(peer_git_dir google/orbax "${1:-}" "$ref")" || exit 2
out="${3:-$repo/build/orbax-suite-out}"
py="${PYTHON:-$repo/.venv/bin/python}"
deps="${DEPS:-$repo/build/orbax-suite-deps}"
work="${WORK:-$repo/build/orbax-suite}"
modes="${MODES:-orbax mithril}"
files="${FILES:-standard pytree manager}"
mithril_src="${MITHRIL_SRC:-$repo}"
per_file_s="${PER_FILE_S:-5400}"
src=checkpoint/orbax/checkpoint
if [ ! -d "$deps/flax" ]; then
  "$py" -m pip install -q --no-deps --target "$deps" flax==0.12.8 optax==0.2.8 chex==0.1.92 \
    portpicker==1.6.0 toolz==1.2.0 treescope==0.1.10 || exit 1
fi
rm -rf "$work" && mkdir -p "$work" "$out"
out="$(cd "$out" && pwd)"
git --git-dir="$orbax_repo" archive "$ref" "$src/_src/handlers/standard_checkpoint_handler_test.py" \
  "$src/_src/handlers/pytree_checkpoint_handler_test.py" "$src/checkpoint_manager_test.py" \
  "$src/_src/testing/multiprocess_test.py" "$src/_src/testing/oss/multiprocess_test.py" \
  "$src/testing" | tar -x -C "$work" || exit 1
mv "$work/$src/_src/handlers/"*_test.py "$work/$src/checkpoint_manager_test.py" "$work/"
mv "$work/$src/_src/testing/multiprocess_test.py" "$work/_multiprocess_test.py"
mv "$work/$src/_src/testing/oss/multiprocess_test.py" "$work/_oss_multiprocess_test.py"
mkdir -p "$work/srcdir/orbax/checkpoint"  # test data (aggregate checkpoints), via TEST_SRCDIR
mv "$work/$src/testing" "$work/srcdir/orbax/checkpoint/testing"
rm -rf "$work/checkpoint"
cp "$here/orbax_site/conftest.py" "$here/orbax_site/"test_mithril_*.py "$work/"
echo "orbax tests from $orbax_repo at $(git --git-dir="$orbax_repo" rev-parse "$ref");" \
  "mithril_async from $mithril_src" | tee "$out/source.txt"

run() {  # mode name file [extra env...]
  local mode="$1" name="$2" file="$3"; shift 3
  case " $files " in *" $name "*) ;; *) return ;; esac
  local tmp; tmp="$(mktemp -d)"
  echo "== $mode $name ($file)"
  ( cd "$work" && env "$@" JAX_PLATFORMS=cpu TEST_TMPDIR="$tmp" TEST_SRCDIR="$work/srcdir" \
      XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      PYTHONPATH="$mithril_src:$deps${PYTHONPATH:+:$PYTHONPATH}" \
      timeout "$per_file_s" "$py" -m pytest -q -p no:cacheprovider -o addopts="" --capture=sys \
        --rootdir="$work" --junitxml="$out/$mode-$name.xml" "$file" > "$out/$mode-$name.log" 2>&1 )
  echo "   exit $? ($(grep -E '(passed|failed).* in [0-9.]+s' "$out/$mode-$name.log" | tail -1);" \
       "$(grep '^mithril_async handlers:' "$out/$mode-$name.log" | tail -1))"
  rm -rf "$tmp"
}
for mode in $modes; do
  case "$mode" in
    orbax)
      run orbax standard standard_checkpoint_handler_test.py
      run orbax pytree pytree_checkpoint_handler_test.py
      run orbax manager checkpoint_manager_test.py ;;
    mithril)
      run mithril standard test_mithril_standard.py
      run mithril pytree test_mithril_pytree.py
      run mithril manager checkpoint_manager_test.py MITHRIL_ORBAX_GLOBAL=1 ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
"$py" "$here/orbax_site/report.py" "$out"
