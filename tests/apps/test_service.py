"""``kvray up`` / ``status`` / ``run --name`` / ``down`` against a real Ray cluster (the
session's three local nodes), each command in a process of its own, as a user runs them:
the runtime outlives ``up``, ``run`` replays on it and leaves it warm, ``down`` stops it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import ray

from kvray.cluster.config import NAMESPACE
from tests.conftest import kvray_command

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NAME = "uptest"


def kvray(*args: str) -> subprocess.CompletedProcess:
    return kvray_command(*args, timeout=180)


def runtime_actors() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(f"{NAME}-")
    ]


@pytest.fixture
def address(ray_cluster):
    yield ray_cluster.address
    if runtime_actors():  # a failed step left the runtime up
        kvray("down", "--address", ray_cluster.address, "--name", NAME)


def test_up_status_run_down(address):
    where = ("--address", address, "--name", NAME)
    up = kvray("up", *where, "--host-pages", "64")
    assert up.returncode == 0, up.stderr[-3000:]
    assert f"kvray runtime '{NAME}' is up" in up.stderr and "3 nodes" in up.stderr
    assert len(runtime_actors()) == 4  # the controller and a store per node, after `up` exited

    again = kvray("up", *where)
    assert again.returncode == 2 and "already running" in " ".join(again.stderr.split())

    def replay(limit: int) -> tuple[dict, str]:
        run = kvray(
            "run",
            *where,
            "--trace",
            "data/traces/conversation_trace_first30min.jsonl",
            "--limit",
            str(limit),
            "--prefill-us-per-token",
            "1",
            "--json",
        )
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1]), " ".join(run.stderr.split())

    replays = [replay(8), replay(8)]  # 157 distinct pages, and the runtime holds 3 x 64
    assert replays[0][0]["requests"] == 8 and replays[0][0]["wrong_pages"] == 0
    assert replays[1][0]["hit_tokens"] > replays[0][0]["hit_tokens"]  # the same requests again, on the warm runtime
    assert not any("distinct pages" in said for _, said in replays)
    _, said = replay(20)  # 540 distinct pages: a run after it would find only some of them
    assert f"this trace has 540 distinct pages and runtime '{NAME}' holds 192 (3 nodes)" in said, said

    status = kvray("status", *where, "--json")
    assert status.returncode == 0, status.stderr[-3000:]
    snapshot = json.loads(status.stdout)
    assert len(snapshot["stores"]) == 3 and snapshot["cluster"]["indexed_pages"] > 0
    assert all(s["tiers"]["host"]["capacity"] == 64 for s in snapshot["stores"].values())

    down = kvray("down", *where)
    assert down.returncode == 0, down.stderr[-3000:]
    assert "3 stores stopped" in down.stderr and not runtime_actors()
    gone = kvray("status", *where)
    assert gone.returncode == 2 and f"no kvray runtime named '{NAME}'" in " ".join(gone.stderr.split())
