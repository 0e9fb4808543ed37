# Two entry points for a fresh clone: `make demo` and `make test`. Each builds .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# In-process tests run on both cores; tests that spawn processes (DDP, SIGKILL, torchrun) run one at a
# time after them, so their timing-sensitive children are not starved.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider

$(BIN)/.installed: requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

.PHONY: demo test lint unit integration venv
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
	$(PYTEST) -m multiprocess tests

test: lint unit integration
