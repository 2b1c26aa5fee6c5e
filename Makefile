# The two entry points of the README. The venv lives outside the clone (cached).
VENV ?= $(HOME)/.cache/atlas/venv
export ATLAS_VENV := $(VENV)
export HF_HUB_OFFLINE := 1
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/atlas demo

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	for b in benchmarks/*.py; do $(VENV)/bin/python $$b || exit 1; done
