# kvray: `make demo` runs the main job on the embedded default; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvray-installed
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/kvray demo

test: install
	$(PY) -m pytest -q -ra

bench: install
	$(VENV)/bin/kvray bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis results
