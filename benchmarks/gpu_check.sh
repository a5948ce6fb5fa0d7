#!/usr/bin/env bash
# shellcheck disable=SC2317  # the stage functions are called through stage()
# make gpu-check: the CUDA paths on a real GPU, in one command (issue 23; docs/GPU.md).
#
#   benchmarks/gpu_check.sh [all|setup|tests|loop|codec|report]   (default: all)
#   benchmarks/gpu_check.sh wheels    # on a machine with registry access, before a GPU session
#
# Without a CUDA device it prints "no CUDA device: gpu-check skipped" and exits 0. With one:
#   setup  its own venv ($GPU_VENV) with a CUDA build of torch, and the project installed in it
#   tests  pytest -m cuda tests/gpu
#   loop   benchmarks/bench_train_loop.py on CUDA: ~1 B-parameter bf16 TinyLM + AdamW, ours
#          (blocking, overlapped) vs DCP async_save with its pinned cached stager vs torch.save
#   codec  benchmarks/bench_codec.py --threads 1,2,4,8,16 against 2.5 / 3.5 GiB/s
#   report benchmarks/gpu_report.py: summary.md, the section to paste into docs/BENCHMARKS.md
# Results go to $GPU_RESULTS (default: $OUT/gpu-results where $OUT is set, else
# /tmp/mithril-gpu-results): summary.md, setup.log, tests.log, loop.log, loop.json, codec.log,
# codec.json (7 files). Exit status: 0 when every stage ran and every CUDA test passed.
#
# Where torch comes from (GPU_TORCH):
#   registry  a fresh venv and `pip install torch==2.13.0` (the version the CPU venv pins): on
#             Linux x86-64 the registry's default torch wheel is the CUDA build (its CUDA
#             runtime comes as nvidia-* wheels); then `pip install -e .` and the test tools.
#   image     the CUDA torch the machine already has (GPU_PYTHON, default python3): a venv whose
#             .pth file puts that interpreter's site-packages after its own, the project's
#             missing dependencies from the wheelhouse $GPU_WHEELS (made by `make gpu-wheels`),
#             and the project with --no-deps --no-build-isolation. For machines that reach no
#             registry (the workplace's lent GPU machines: torch 2.11 + CUDA 13 in their image).
#   auto      (default) registry when `pip index versions torch` lists 2.13.0 within
#             $GPU_PROBE_S seconds, else image.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

STAGE=${1:-all}
GPU_TORCH=${GPU_TORCH:-auto}
GPU_TORCH_VERSION=${GPU_TORCH_VERSION:-2.13.0}
GPU_PYTHON=${GPU_PYTHON:-python3}
GPU_VENV=${GPU_VENV:-build/venv-gpu}
GPU_WHEELS=${GPU_WHEELS:-build/gpu-wheels}
GPU_WHEEL_PY=${GPU_WHEEL_PY:-3.12}
GPU_PROBE_S=${GPU_PROBE_S:-20}
GPU_PARAMS=${GPU_PARAMS:-1e9}
GPU_SAVES=${GPU_SAVES:-5}
GPU_BATCH=${GPU_BATCH:-8}
GPU_CTX=${GPU_CTX:-512}
GPU_THREADS=${GPU_THREADS:-1,2,4,8,16}
GPU_CODEC_PARAMS=${GPU_CODEC_PARAMS:-2e8}
GPU_RUNS=${GPU_RUNS:-3}
GPU_SCRATCH=${GPU_SCRATCH:-}
if [ -n "${GPU_RESULTS:-}" ]; then
    RESULTS=$GPU_RESULTS
elif [ -n "${OUT:-}" ]; then
    RESULTS=$OUT/gpu-results
else
    RESULTS=/tmp/mithril-gpu-results
fi
PY=$GPU_VENV/bin/python
export PYTHONUNBUFFERED=1  # logs are tee'd: keep them whole if the run is cut short

# The project's runtime dependencies the GPU image lacks (it has torch, numpy, xxhash,
# safetensors, aiofiles, uvloop, pytest, pytest-timeout, hypothesis), at the CPU venv's
# versions, plus the build requirements. aioboto3 is imported only for S3 stores: not needed.
WHEELS=(zstandard==0.25.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing_extensions==4.16.0 cffi==2.1.1 pycparser==3.12
        zlib-ng==1.1.0 deflate==0.9.0 setuptools==84.2.1 wheel==0.45.1)
NEEDS=(zstandard pydantic cffi zlib-ng deflate "setuptools>=68" wheel)

say() { printf '\n== gpu-check: %s\n' "$*"; }

has_cuda() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

wheels() {
    local pip=${PIP:-}
    if [ -z "$pip" ]; then
        if [ -x .venv/bin/pip ]; then pip=".venv/bin/pip"; else pip="python3 -m pip"; fi
    fi
    mkdir -p "$GPU_WHEELS"
    say "downloading ${#WHEELS[@]} wheels for CPython $GPU_WHEEL_PY x86-64 into $GPU_WHEELS"
    $pip download -q --no-deps --only-binary=:all: --python-version "$GPU_WHEEL_PY" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$GPU_WHEELS" "${WHEELS[@]}" || return 1
    du -sh "$GPU_WHEELS"
    echo "carry $GPU_WHEELS to the GPU machine with the working tree (docs/GPU.md)"
}

registry_has_torch() {
    command -v timeout >/dev/null 2>&1 || return 1
    timeout "$GPU_PROBE_S" "$GPU_PYTHON" -m pip index versions torch --timeout 5 --retries 0 \
        2>/dev/null | grep -q "$GPU_TORCH_VERSION"
}

image_torch_ok() {
    "$GPU_PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}

setup_registry() {
    rm -rf "$GPU_VENV"
    "$GPU_PYTHON" -m venv "$GPU_VENV" || return 1
    "$PY" -m pip install -q --upgrade pip || return 1
    echo "torch==$GPU_TORCH_VERSION from the registry (CUDA build on Linux x86-64)"
    "$PY" -m pip install -q "torch==$GPU_TORCH_VERSION" || return 1
    "$PY" -m pip install -q -e . pytest pytest-timeout hypothesis || return 1
}

setup_image() {
    image_torch_ok || { echo "$GPU_PYTHON has no torch that sees a CUDA device"; return 1; }
    ls "$GPU_WHEELS"/*.whl >/dev/null 2>&1 || {
        echo "no wheels in $GPU_WHEELS: run 'make gpu-wheels' where a registry is reachable"
        echo "and carry $GPU_WHEELS to this machine (docs/GPU.md)"
        return 1
    }
    rm -rf "$GPU_VENV"
    "$GPU_PYTHON" -m venv --without-pip "$GPU_VENV" || return 1
    local site
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    # the image's site-packages (torch and friends, pip too) after the venv's own
    "$GPU_PYTHON" -c 'import sys; print("\n".join(p for p in sys.path
                      if p.endswith(("site-packages", "dist-packages"))))' \
        > "$site/_gpu_image_site.pth" || return 1
    echo "torch from $GPU_PYTHON (the machine's image), seen through $site/_gpu_image_site.pth"
    "$PY" -m pip install -q --no-index --find-links "$GPU_WHEELS" "${NEEDS[@]}" || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . && return 0
    # no C compiler or Python headers here: use native modules built elsewhere (x86-64,
    # abi3), carried in mithril_async/ with the working tree, and the tree itself on sys.path
    if ls mithril_async/_kernels*.so mithril_async/_rans*.so >/dev/null 2>&1; then
        echo "the native build failed: using the carried mithril_async/_kernels, _rans modules"
        echo "$ROOT" > "$site/_gpu_project.pth"
        return 0
    fi
    echo "the native build failed; carry mithril_async/_kernels.abi3.so and _rans.abi3.so"
    return 1
}

setup() {
    local mode=$GPU_TORCH
    if [ "$mode" = auto ]; then
        if registry_has_torch; then mode=registry; else mode=image; fi
    fi
    say "setup ($mode) -> $GPU_VENV"
    case $mode in
        registry) setup_registry || return 1 ;;
        image) setup_image || return 1 ;;
        *) echo "GPU_TORCH must be auto, registry or image, not '$mode'"; return 1 ;;
    esac
    echo "$mode" > "$GPU_VENV/.torch-source"
    "$PY" - <<'EOF' || return 1
import torch
from mithril_async.codec import kernels as K

assert torch.cuda.is_available(), "torch in the venv sees no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on "
      f"{torch.cuda.get_device_name()}; kernels {K.BACKEND}")
assert K.native_available(), "the native kernels did not build"
EOF
}

ensure_venv() {
    [ -x "$PY" ] && "$PY" -c 'import torch, mithril_async' >/dev/null 2>&1 && return 0
    setup
}

run_tests() {
    say "tests: pytest -m cuda tests/gpu"
    "$PY" -m pytest -m cuda tests/gpu -v -rs -p no:cacheprovider
}

run_loop() {
    say "loop: bench_train_loop.py --device cuda --params $GPU_PARAMS bf16, $GPU_SAVES saves"
    local scratch=()
    [ -n "$GPU_SCRATCH" ] && scratch=(--out-dir "$GPU_SCRATCH")
    "$PY" benchmarks/bench_train_loop.py --device cuda \
        --params "$GPU_PARAMS" --dtype bfloat16 --batch "$GPU_BATCH" --ctx "$GPU_CTX" \
        --saves "$GPU_SAVES" --prune "${scratch[@]}" --json "$RESULTS/loop.json"
}

run_codec() {
    say "codec: bench_codec.py --threads $GPU_THREADS (state of a $GPU_CODEC_PARAMS TinyLM)"
    "$PY" benchmarks/bench_codec.py --threads "$GPU_THREADS" \
        --params "$GPU_CODEC_PARAMS" --device cuda --runs "$GPU_RUNS" \
        --json "$RESULTS/codec.json"
}

run_report() {
    say "report: $RESULTS/summary.md"
    "$PY" benchmarks/gpu_report.py --results "$RESULTS" \
        --torch-source "$(cat "$GPU_VENV/.torch-source" 2>/dev/null || echo unknown)" \
        | tee "$RESULTS/summary.md"
}

if [ "$STAGE" = wheels ]; then
    wheels
    exit $?
fi
if ! has_cuda; then
    echo "no CUDA device: gpu-check skipped (nvidia-smi lists no GPU; see docs/GPU.md)"
    exit 0
fi
mkdir -p "$RESULTS"
echo "results: $RESULTS"
status=0
# $1 stage name, $2 log file (under $RESULTS), $3 the function; the log keeps everything
stage() {
    local rc
    "$3" 2>&1 | tee "$RESULTS/$2"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "gpu-check: stage $1 failed (exit $rc)"; status=1; }
    return "$rc"
}
case $STAGE in
    all)
        stage setup setup.log setup || exit 1
        stage tests tests.log run_tests
        stage loop loop.log run_loop
        stage codec codec.log run_codec
        run_report ;;
    setup) stage setup setup.log setup ;;
    tests) ensure_venv && stage tests tests.log run_tests ;;
    loop) ensure_venv && stage loop loop.log run_loop ;;
    codec) ensure_venv && stage codec codec.log run_codec ;;
    report) ensure_venv && run_report ;;
    *) echo "usage: $0 [all|setup|tests|loop|codec|report|wheels]"; exit 2 ;;
esac
[ "$status" -eq 0 ] && echo "gpu-check: done" || echo "gpu-check: some stage failed (above)"
exit "$status"
