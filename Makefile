# Quick start: `make demo` runs the example, `make test` runs the whole suite.
# Both create .venv, install wasibox into it, and build + compile the guest (cached).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test prepare microvm microvm-deps lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

prepare: $(VENV)/.installed
	$(BIN)/wasibox prepare

demo: prepare
	$(BIN)/python examples/demo.py examples/data/orders.csv

# The microVM backend (numpy, pandas, ...) needs QEMU, bubblewrap and the Debian tools that
# build its image; as root they are installed here, once. Its image and template snapshot
# are built ahead (cached by content; a few minutes the first time).
MICROVM_DEBS := qemu-system-x86 bubblewrap debootstrap erofs-utils kmod busybox-static
microvm-deps:
	@missing=$$(for p in $(MICROVM_DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q --no-install-recommends $$missing; \
	else \
		echo "microvm: not root, skipping: apt-get install" $$missing; \
	fi

microvm: microvm-deps $(VENV)/.installed
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/wasibox microvm build; \
	else echo "microvm: building the image needs root: sudo $(BIN)/wasibox microvm build"; fi

test: prepare microvm
	$(BIN)/python -m pytest

# ruff, then the format check (pycodestyle's layout rules: `ruff format` would impose
# another style than the house's aligned continuation lines), then strict mypy.
lint: $(VENV)/.installed
	$(BIN)/ruff check wasibox tests bench examples guest
	$(BIN)/ruff check --preview --select E1,E2,E3,W wasibox tests bench examples guest
	$(BIN)/mypy

bench: prepare
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/transform.py
	$(BIN)/python bench/fuzz.py
	$(BIN)/python bench/host_calls.py

clean:
	rm -rf $(VENV) build dist *.egg-info
