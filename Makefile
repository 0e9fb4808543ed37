# Two entry points for a fresh clone: `make demo` and `make test`. Each builds .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# In-process tests run on both cores; tests that spawn processes (DDP, SIGKILL, torchrun) run one at a
# time after them, so their timing-sensitive children are not starved. `make test` (CI) runs a covering
# subset of the kill-and-resume matrices; `make test-all` adds the rest (the `extended` marker).
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider

$(BIN)/.installed: requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

.PHONY: demo test test-all lint unit integration integration-all venv
venv: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/python examples/resume_proof.py

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(PYTEST) -n 2 -m "not multiprocess" tests

integration: $(BIN)/.installed
	$(PYTEST) -m "multiprocess and not extended" tests

integration-all: $(BIN)/.installed
	$(PYTEST) -m multiprocess tests

test: lint unit integration

test-all: lint unit integration-all
