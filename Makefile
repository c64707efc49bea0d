# Two commands on a fresh machine (each sets up what it needs first, reusing what is already there):
#   make run     the headline job: objective=masked_patch on the built-in synthetic data (ARGS="..." adds overrides);
#                needs only Python >= 3.11 and PyPI: a venv with the core install (pip install -c constraints.txt -e .)
#   make test    ruff, then the whole test suite (what CI runs), after make setup
# and for the inner loop and the guard when tests move:
#   make test-fast   the tests marked neither slow nor distributed (unit level, no process started)
#   make coverage    the whole suite under coverage.py (subprocesses and forked ranks included): a report of the
#                    lines of ssl_vit/ and objectives/ it runs, and coverage.json
# `make setup` installs what the tests need: the virtual environment (.venv, pip install -c constraints.txt -e
# '.[dev]', again when pyproject.toml or constraints.txt changes), transformers 4.x beside 5.x for one interop test,
# the Debian data sets (Fashion-MNIST, Tux Paint) and DeepSpeed's shared-memory op.
# `make wheelhouse` builds the wheels that install ssl-vit offline beside a Python that has torch (tools/wheelhouse.py).
# The first Python >= 3.11 on PATH (3.11 first: constraints.txt was resolved there); PYTHON=... chooses another
PYTHON ?= $(firstword $(foreach p,python3.11 python3.12 python3.13 python3,$(shell $(p) -c 'import sys; print(sys.version_info >= (3, 11))' 2>/dev/null | grep -q True && echo $(p))))
VENV := .venv
ARGS ?=
# pytest-xdist workers for make test and make test-fast (-n; tests/helpers/cores.py); WORKERS=0: in pytest's own process
WORKERS ?= 2

.PHONY: setup run test test-fast coverage lock floors wheelhouse python docs
setup: $(VENV)/.installed $(VENV)/.data-installed $(VENV)/.ops-built

python:
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.11 on PATH (python3.11, python3.12, python3.13, python3); install one or pass PYTHON=/path/to/python" >&2; exit 1; }

# the core: what make run needs (no dev tools, no extras, no data sets)
$(VENV)/.core-installed: pyproject.toml constraints.txt | python
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -c constraints.txt -e .
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt | python
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -c constraints.txt -e '.[dev]'
	bash scripts/get_transformers4.sh
	touch $@ $(VENV)/.core-installed

$(VENV)/.data-installed: scripts/get_data.sh | $(VENV)/.installed
	bash scripts/get_data.sh
	touch $@

# DeepSpeed compiles its shared-memory collective (a C++ op: ~75 s on 2 cores) in the first ZeRO run on a machine
# and caches it (~/.cache/torch_extensions); built here once, by DeepSpeed's own function, not inside that run.
$(VENV)/.ops-built: | $(VENV)/.installed
	$(VENV)/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

run: $(VENV)/.core-installed
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

# The docs site (docs/, mkdocs.yml) into site/, failing on any warning (a broken link or anchor, a page not in nav)
docs: setup
	$(VENV)/bin/mkdocs build --strict

# constraints.txt anew: pyproject.toml's floors resolved to today's releases in a fresh venv, frozen (commit it)
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q -e '.[dev]'
	head -2 constraints.txt > .constraints.new
	.lock-venv/bin/pip freeze --exclude-editable | grep -v '^ssl-vit' >> .constraints.new
	mv .constraints.new constraints.txt
	rm -rf .lock-venv

# The declared floors, checked once (not in CI: PyPI's torch wheels carry CUDA, several GB): constraints-floors.txt
# installed into .floors-venv under $(FLOOR_PYTHON), then the fast tier there
FLOOR_PYTHON ?= python3.12
floors:
	rm -rf .floors-venv
	$(FLOOR_PYTHON) -m venv .floors-venv
	.floors-venv/bin/pip install -q -c constraints-floors.txt torch torchvision
	.floors-venv/bin/pip install -q -c constraints-floors.txt -e '.[hf,deepspeed,onnx]' pytest pytest-xdist scikit-image==0.22.0
	.floors-venv/bin/pip freeze > .floors-venv/freeze.txt
	.floors-venv/bin/python -m pytest -q -n $(WORKERS) --dist loadgroup -m "not slow and not distributed" $(ARGS)

# Wheels that install ssl-vit offline beside a Python that already has torch: by default for the GPU node this
# project's figures come from (Python 3.12, torch 2.11, transformers 5.17, timm 1.0.29, accelerate 1.15), with
# DeepSpeed. HAVE_FILE=<pip freeze of the target> is the exact form; CHECK=<a python3.12 here> verifies the install.
WHEELHOUSE ?= wheelhouse
PYTHON_VERSION ?= 3.12
PLATFORM ?= manylinux_2_28_x86_64
HAVE ?= torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 timm==1.0.29 accelerate==1.15.0 safetensors scipy \
	scikit-learn tensorboard matplotlib numpy pillow
EXTRAS ?= deepspeed
wheelhouse: | python
	$(PYTHON) tools/wheelhouse.py --out $(WHEELHOUSE) --python-version $(PYTHON_VERSION) --platform $(PLATFORM) \
		--have "$(HAVE)" --extras "$(EXTRAS)" $(if $(HAVE_FILE),--have-file $(HAVE_FILE)) $(if $(CHECK),--check $(CHECK))
