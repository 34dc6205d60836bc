# kvmesh: `make up` serves the default model; `make test` runs the whole suite.
# Both start with `make install`, which is idempotent: it does nothing when the
# venv, the pinned dependencies and the prepared default model are in place.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Stamp files make the steps idempotent: each reruns only when its inputs change.
DEPS_STAMP := $(VENV)/.deps-installed

.PHONY: install up test test-fast soak lint format protos bench clean

install: $(DEPS_STAMP)
	@# Checks a marker in the model cache; converts only the first time.
	@$(BIN)/python -m kvmesh.services.runtime.model_prep >/dev/null
	@# Compiles the C++ CPU kernels once per source/torch, for each instruction-set
	@# level this CPU runs (kernels/native.py, kernels/cpu_isa.py).
	@# Without a compiler the stack still runs (torch CPU path); the tests fail.
	@$(BIN)/python -m kvmesh.kernels.native build >/dev/null \
		|| echo "kvmesh: C++ kernels not built (reason above); serving falls back to the torch CPU path"
	@# The kvstore's Redis tier tests run a real redis-server; install it where we may.
	@if ! command -v redis-server >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
				|| echo "kvmesh: apt-get could not install redis-server; Redis tier tests will skip"; \
		else \
			echo "kvmesh: no redis-server (needs root and apt-get here); Redis tier tests will skip"; \
		fi; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, by exact version, so that pip takes the CPU build on this
# machine's disk and no later resolution can pull a CUDA build.
$(DEPS_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

up: install
	$(BIN)/kvmesh up

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not e2e"

# Nothing lost under chaos: 2,000 streams, client hang-ups, SIGKILLs (benchmarks/soak.py).
# Its flags go through SOAK_ARGS, e.g. `make soak SOAK_ARGS=--batch-invariant`.
SOAK_ARGS ?=
soak: install
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: $(DEPS_STAMP)
	$(BIN)/python -m kvmesh.protos.build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
