"""``ray job submit --working-dir . -- python -m kvray run ...`` against a real Ray head,
beside a runtime ``kvray up`` keeps under the default name.

This starts its own head (the session cluster has no dashboard, and job submission goes
through the dashboard's job server, ~1 GB), with token authentication on as Ray 2.60 does
by default: the head and the ``ray job submit`` client share a token through
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (README: "Running on a Ray cluster").
It takes about a minute, so it is marked ``slow`` but runs in the default suite: it is the
only check that kvray works as a submitted job.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster.test_launcher import free_port, stop_own_ray

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def wait_for_dashboard(port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=5)
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without the token): it is up
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the dashboard on port {port} did not come up")


def wait_for_job_server(ray_bin: Path, port: int, env: dict, timeout_s: float = 120) -> None:
    """The dashboard answers before its job module does; wait until ``ray job list`` works."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probe = subprocess.run(
            [str(ray_bin), "job", "list", "--address", f"http://127.0.0.1:{port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return
        time.sleep(1)
    raise TimeoutError(f"the job server on port {port} did not come up: {probe.stderr[-1000:]}")


def submit_when_an_agent_is_up(command: list[str], env: dict, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``ray job submit``, retried while the head's job agent has not registered yet (on a
    busy machine the dashboard answers before its agent does)."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        if job.returncode == 0 or "No available agent" not in job.stderr or time.monotonic() > deadline:
            return job
        time.sleep(2)


def test_ray_job_submit_runs_kvray_and_prints_the_json():
    # Short: Ray's unix socket paths under the temp dir must stay under 108 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    try:
        submit_a_job(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def submit_a_job(tmp_path: Path) -> None:
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    bin_dir = Path(sys.executable).parent  # the job's `python` must be this environment's
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    ray_bin = bin_dir / "ray"
    port, dashboard = free_port(), free_port()
    head = subprocess.Popen(
        [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=true",
            f"--dashboard-port={dashboard}",
            "--object-store-memory=150000000",
            f"--temp-dir={tmp_path / 'ray'}",
            # Own agent ports: the defaults may be held by the session cluster's nodes.
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kvray = [sys.executable, "-m", "kvray"]
    where = ["--address", f"127.0.0.1:{port}"]
    try:
        wait_for_dashboard(dashboard)
        wait_for_job_server(ray_bin, dashboard, env)
        # A runtime kept up under the default name, as README's "Keeping a runtime up" leaves
        # one: the job's `kvray run` must start its own beside it.
        up = subprocess.run(
            [*kvray, "up", *where, "--host-pages", "16"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
        )
        assert up.returncode == 0, up.stderr[-3000:]
        job = submit_when_an_agent_is_up(
            [
                str(ray_bin),
                "job",
                "submit",
                "--address",
                f"http://127.0.0.1:{dashboard}",
                "--working-dir",
                ".",
                "--",
                "python",
                "-m",
                "kvray",
                "run",
                "--trace",
                "data/traces/conversation_trace_first30min.jsonl",
                "--limit",
                "12",
                "--host-pages",
                "64",
                "--prefill-us-per-token",
                "1",
                "--json",
            ],
            env,
        )
        down = subprocess.run([*kvray, "down", *where], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert down.returncode == 0, down.stderr[-3000:]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        stop_own_ray(head, str(tmp_path / "ray"))
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    result = json.loads(next(line for line in job.stdout.splitlines() if line.startswith('{"requests"')))
    assert result["requests"] == 12 and result["policy"] == "lru" and result["tokens"] > 0
    assert "succeeded" in job.stdout
    assert "this replay starts its own as 'kvray-2'" in " ".join(job.stdout.split())
