"""The wheel works when installed: built from this checkout, installed into a fresh
virtual environment outside it, it finds its shipped policy, scenarios and traces and
runs ``kvray sim --policy rl``.

The fresh environment gets kvray from the wheel alone; its third-party dependencies are
made importable from this test's environment through a ``.pth`` line (installing torch
and Ray again would take minutes and a download). That line adds a plain directory, so the
editable kvray of this environment is not visible there; the test checks which kvray ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args}: {done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_runs_the_shipped_policy(tmp_path):
    # build from a copy: setuptools' build/ folder keeps modules removed since the last build
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "results", "__pycache__", "*.so")
    )
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, source, cwd=tmp_path)
    (wheel,) = wheels.glob("kvray-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kvray/_bundled/policies/default/policy.safetensors" in names
    assert "kvray/_bundled/simulations/h100-llama8b.yaml" in names
    assert "kvray/_bundled/data/traces/synthetic_trace.jsonl" in names
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names), "only the kvray package is installed"
    assert any(n.startswith("kvray/core/_tokens.") and n.endswith(".so") for n in names), "the token extension is compiled"
    assert any(n.startswith("kvray/sim/_chain.") and n.endswith(".so") for n in names), "the chain writer is compiled"

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (site / "kvray_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = run(python, "-c", "import kvray; print(kvray.__file__)", cwd=tmp_path, env=env)
    assert where.startswith(str(site)), f"kvray imported from {where}, not the fresh environment"
    for module, extension in (
        ("kvray.core.keys", "_tokens"),
        ("kvray.core.pages", "_pagecopy"),
        ("kvray.sim.node", "_chain"),
        ("kvray.policy.reuse", "_pool"),
    ):  # every C extension of setup.py built into the wheel and loaded by the module that uses it
        run(python, "-c", f"from {module} import {extension}; assert {extension} is not None", cwd=tmp_path, env=env)
    out = run(
        venv / "bin" / "kvray",
        "sim",
        "--policy",
        "rl",
        "--trace",
        "synthetic_trace.jsonl",
        "--limit",
        "300",
        "--capacity-fraction",
        "0.1",
        "--json",
        cwd=tmp_path,
        env=env,
    )
    result = json.loads(out)
    assert result["policy"] == "rl" and result["requests"] == 300 and result["hit_tokens"] > 0
