# One entry point for people and CI: `make test` (what .ci/run calls), `make demo`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fxpure-installed

.PHONY: setup test check demo bench clean

setup: $(STAMP)

# torch first and pinned exactly: the CPU wheel on this machine's disk; a loose spec pulls a CUDA build
$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

check: setup
	$(BIN)/mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: check
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/fxpure demo

bench: setup
	$(BIN)/python -m benchmarks.bench_fuse
	$(BIN)/python -m benchmarks.bench_split
	$(BIN)/python -m benchmarks.bench_qconv

clean:
	rm -rf $(VENV)
