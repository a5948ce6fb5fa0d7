# Two entry points a new user needs; both do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo demo-s3 test lint bench

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
