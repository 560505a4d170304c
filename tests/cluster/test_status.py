"""Metrics of a running runtime: ``kvray status`` and the Prometheus export."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.core.config import PageLayout, TierSizes

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")


@pytest.fixture(scope="module")
def busy_runtime(ray_cluster):
    """A runtime that has served one request twice (one miss, one hit)."""
    runtime = Runtime.start(RuntimeConfig(name="status", layout=LAYOUT, tiers=TierSizes(host=16)))
    client = KvrayClient.connect("status", buffer_pages=8)
    keys = client.keys_for_trace([1, 2, 3, 4])
    for _ in range(2):
        plan = client.lookup(keys)
        loaded = client.load(keys, plan)
        client.release(plan, loaded)
        client.buffer.pages[loaded.pages : 4] = np.arange(4 - loaded.pages, dtype=np.uint8)[:, None]
        client.store(keys, loaded.pages, plan)
    yield runtime
    client.close()
    runtime.close()


def test_kvray_status_prints_the_metrics_of_a_running_cluster(busy_runtime, ray_cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "kvray", "status", "--address", ray_cluster.address, "--name", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    cluster = status["cluster"]
    assert cluster["lookup_pages"] == 8 and cluster["page_hit_rate"] == 0.5
    assert cluster["hit_pages_by_tier"] == {"host": 4} and cluster["indexed_pages"] == 4
    assert len(status["stores"]) == 3
    for stats in status["stores"].values():
        assert {"occupancy", "fragmentation"} <= set(stats["tiers"]["host"])
        assert "bytes_moved" in stats and "swap_latency" in stats
    assert sum(s["tiers"]["host"]["used"] for s in status["stores"].values()) == 4


def test_status_of_an_unknown_runtime_is_a_clear_error(ray_cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "kvray", "status", "--address", ray_cluster.address, "--name", "nobody"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "no kvray runtime named 'nobody'" in " ".join(proc.stderr.split())


def test_metrics_reach_prometheus_through_ray(busy_runtime):
    """The actors' gauges appear in the Prometheus text Ray's metrics agents serve."""
    ray.get(busy_runtime.controller.status.remote())  # every store and the controller export
    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
    wanted = {
        "kvray_hit_rate",
        "kvray_hit_pages",
        "kvray_occupancy",
        "kvray_fragmentation",
        "kvray_swap_latency_seconds",
        "kvray_bytes_moved",
    }
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not wanted <= seen:
        for port in ports:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            seen |= {
                line.split("{")[0].split(" ")[0].removeprefix("ray_")
                for line in text.splitlines()
                if "kvray_" in line and not line.startswith("#")
            }
        time.sleep(1)
    assert wanted <= seen, f"missing {wanted - seen}"
