# Quick start: `make demo` runs the example, `make test` runs the whole suite.
# Both create .venv, install wasibox into it, and build + compile the guest (cached).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test prepare lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

prepare: $(VENV)/.installed
	$(BIN)/wasibox prepare

demo: prepare
	$(BIN)/python examples/demo.py examples/data/orders.csv

test: prepare
	$(BIN)/python -m pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check wasibox tests bench examples
	$(BIN)/mypy

bench: prepare
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/transform.py
	$(BIN)/python bench/fuzz.py
	$(BIN)/python bench/host_calls.py

clean:
	rm -rf $(VENV) build dist *.egg-info
