# Two entry points a new user needs; both do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo demo-s3 test lint bench gpu-check gpu-wheels

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0

setup: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

demo: setup
	$(BIN)/python examples/train_loop.py

demo-s3: setup
	$(BIN)/python examples/s3_demo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

# The CUDA paths on a real GPU (docs/GPU.md): without a CUDA device it says so and exits 0;
# with one it makes its own venv (build/venv-gpu) with a CUDA torch, runs the `cuda` tests,
# the training-loop benchmark on the GPU and the codec thread sweep, and prints the
# docs/BENCHMARKS.md section. Stages alone: benchmarks/gpu_check.sh setup|tests|loop|codec.
gpu-check:
	bash benchmarks/gpu_check.sh all

# Where a registry is reachable, before a GPU session on a machine that reaches none: the
# wheels gpu-check installs there (build/gpu-wheels, ~9 MB; carry it with the working tree).
gpu-wheels:
	bash benchmarks/gpu_check.sh wheels
