# `make demo` and `make test` work on a fresh machine: the first run creates .venv and
# installs eqfuse with its pinned dependencies (CPU torch; Triton for its interpreter).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eqfuse-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m eqfuse.cli demo

test: $(STAMP)
	$(PY) -m pytest -n auto tests

lint: $(STAMP)
	$(PY) -m ruff check eqfuse tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
