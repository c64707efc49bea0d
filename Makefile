# Two commands on a fresh machine (each sets everything up first, reusing what is already there):
#   make run     the headline job: objective=masked_patch on the built-in synthetic data (ARGS="..." adds overrides)
#   make test    the test suite (what CI runs)
# `make setup` alone installs: the virtual environment (.venv, pip install -e '.[dev]', again when pyproject.toml
# changes), transformers 4.x beside 5.x for one interop test, and the Debian data sets (Fashion-MNIST, Tux Paint).
PYTHON ?= python3.11
VENV := .venv
ARGS ?=

.PHONY: setup run test
setup: $(VENV)/.installed $(VENV)/.data-installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -e '.[dev]'
	bash scripts/get_transformers4.sh
	touch $@

$(VENV)/.data-installed: scripts/get_data.sh | $(VENV)/.installed
	bash scripts/get_data.sh
	touch $@

run: setup
	$(VENV)/bin/python scripts/pretrain.py objective=masked_patch $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(ARGS)
