# Two commands on a fresh machine (each sets everything up first, reusing what is already there):
#   make run     the headline job: objective=masked_patch on the built-in synthetic data (ARGS="..." adds overrides)
#   make test    ruff, then the whole test suite (what CI runs)
# and for the inner loop and the guard when tests move:
#   make test-fast   the tests marked neither slow nor distributed (unit level, no process started)
#   make coverage    the whole suite under coverage.py (subprocesses and forked ranks included): a report of the
#                    lines of ssl_vit/ and objectives/ it runs, and coverage.json
# `make setup` alone installs: the virtual environment (.venv, pip install -c constraints.txt -e '.[dev]', again
# when pyproject.toml or constraints.txt changes), transformers 4.x beside 5.x for one interop test, the Debian data sets (Fashion-MNIST, Tux Paint) and
# DeepSpeed's shared-memory op.
PYTHON ?= python3.11
VENV := .venv
ARGS ?=
# pytest-xdist workers for make test and make test-fast (-n; tests/helpers/cores.py); WORKERS=0: in pytest's own process
WORKERS ?= 2

.PHONY: setup run test test-fast coverage lock
setup: $(VENV)/.installed $(VENV)/.data-installed $(VENV)/.ops-built

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -c constraints.txt -e '.[dev]'
	bash scripts/get_transformers4.sh
	touch $@

$(VENV)/.data-installed: scripts/get_data.sh | $(VENV)/.installed
	bash scripts/get_data.sh
	touch $@

# DeepSpeed compiles its shared-memory collective (a C++ op: ~75 s on 2 cores) in the first ZeRO run on a machine
# and caches it (~/.cache/torch_extensions); built here once, by DeepSpeed's own function, not inside that run.
$(VENV)/.ops-built: | $(VENV)/.installed
	$(VENV)/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

run: setup
	$(VENV)/bin/python scripts/pretrain.py objective=masked_patch $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadgroup $(ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadgroup -m "not slow and not distributed" $(ARGS)

coverage: setup
	rm -f .coverage .coverage.*
	COVERAGE_FILE=$(CURDIR)/.coverage $(VENV)/bin/python -m coverage run -m pytest -q $(ARGS)
	$(VENV)/bin/python -m coverage combine -q
	$(VENV)/bin/python -m coverage report --skip-covered --sort=cover
	$(VENV)/bin/python -m coverage json -q -o coverage.json

# constraints.txt anew: pyproject.toml's floors resolved to today's releases in a fresh venv, frozen (commit it)
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q -e '.[dev]'
	head -2 constraints.txt > .constraints.new
	.lock-venv/bin/pip freeze --exclude-editable | grep -v '^ssl-vit' >> .constraints.new
	mv .constraints.new constraints.txt
	rm -rf .lock-venv
