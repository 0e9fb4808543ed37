# Two entry points for a fresh clone: `make demo` and `make test`. Each builds .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

.PHONY: demo test venv
venv: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/python examples/resume_proof.py

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests
