"""``make gpu-check`` and ``kvray bench --only gpu`` on a machine without CUDA: each says
so and succeeds, and nothing is installed.

The CUDA branch itself (``kvray/apps/gpu_check.py`` in ``.venv-gpu``) needs a GPU; this
test forces the other branch by running make with a PATH that has no ``nvidia-smi``, so
it checks the same thing on any machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").symlink_to(shutil.which("make"))
    venv = tmp_path / "gpu-venv"
    done = subprocess.run(
        ["make", "-C", str(ROOT), "--no-print-directory", "gpu-check", f"GPU_VENV={venv}"],
        env={**os.environ, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device" in done.stdout
    assert not venv.exists()  # nothing installed


def test_gpu_benchmarks_without_cuda_say_so_and_report_nothing():
    done = subprocess.run(
        [sys.executable, "-m", "kvray", "bench", "--only", "gpu", "--json"],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # also on a GPU machine: torch sees none
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    for name in ("gpu_device_tier", "gpu_vllm_ttft"):
        assert f"{name} not run: no CUDA device" in done.stderr
