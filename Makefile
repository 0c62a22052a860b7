# meshrl developer commands. `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo demo-ppo test test-fast test-slow protos bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 is on local disk; an unpinned torch would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/meshrl up examples/arith/grpo.yaml

demo-ppo: install
	$(VENV)/bin/meshrl up examples/arith/ppo.yaml

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

protos: install
	bash protos/generate.sh

clean:
	rm -rf runs .pytest_cache
