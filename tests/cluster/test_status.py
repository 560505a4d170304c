"""Metrics of a running runtime: ``kvray status`` and the Prometheus export."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.protocol import LOCAL_LEASE
from kvray.core.config import PageLayout, TierSizes
from tests.conftest import kvray_command
from tests.test_report import shows_whole

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
        with client.request(keys) as r:
            r.rows[r.hit :] = np.arange(4 - r.hit, dtype=np.uint8)[:, None]
            r.store()
    yield runtime
    client.close()
    runtime.close()


def test_kvray_status_prints_the_metrics_of_a_running_cluster(busy_runtime, ray_cluster):
    proc = kvray_command("status", "--address", ray_cluster.address, "--name", "status", "--json", timeout=120)
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
    # The hit was copied out of the mapped host tier, with no call to the store: the store
    # still counts its bytes and its latency, reported by the client afterwards.
    page_bytes = LAYOUT.page_nbytes
    assert sum(s["bytes_loaded"] for s in status["stores"].values()) == 4 * page_bytes
    assert sum(s["bytes_stored"] for s in status["stores"].values()) == 4 * page_bytes
    loads = [s["swap_latency"]["load"] for s in status["stores"].values() if "load" in s["swap_latency"]]
    assert len(loads) == 1 and loads[0]["count"] == 1 and loads[0]["p99_s"] > 0


def test_kvray_status_table_shows_whole_scaled_figures_on_a_narrow_terminal(busy_runtime, ray_cluster):
    proc = kvray_command(
        "status", "--address", ray_cluster.address, "--name", "status", timeout=120, env={**os.environ, "COLUMNS": "40"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = f"{4 * LAYOUT.page_nbytes / 2**10:.1f} KiB"  # the hit's 4 pages, and the 4 stored
    assert shows_whole(proc.stderr, loaded, "4 / 16"), proc.stderr
    assert proc.stderr.count(loaded) == 2 and re.search(r"│ +[\d.]+ (us|ms) │", proc.stderr), proc.stderr


def test_status_of_an_unknown_runtime_is_a_clear_error(ray_cluster):
    proc = kvray_command("status", "--address", ray_cluster.address, "--name", "nobody", timeout=120)
    assert proc.returncode == 2 and "no kvray runtime named 'nobody'" in " ".join(proc.stderr.split())


def test_metrics_reach_prometheus_through_ray(busy_runtime):
    """The actors' gauges appear in the Prometheus text Ray's metrics agents serve."""
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
        # every store and the controller export on status; asked each round, since the hit's
        # report reaches the controller after the request returns (later on a loaded machine)
        ray.get(busy_runtime.controller.status.remote())
        for port in ports:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            seen |= {
                line.split("{")[0].split(" ")[0].removeprefix("ray_")
                for line in text.splitlines()
                if "kvray_" in line and not line.startswith("#")
            }
        time.sleep(1)
    assert wanted <= seen, f"missing {wanted - seen}"


def test_kvray_status_shows_every_controller_shard(ray_cluster):
    """A 2-shard runtime with chains under 8 tenant salts: the table names both shards, and
    the JSON's cluster figures are the sum of the shards'. Looked up again, the chains are
    answered from the node's mapped host tier with no controller call, and those reports
    reach their shards through the store."""
    runtime = Runtime.start(RuntimeConfig(name="status-shards", layout=LAYOUT, tiers=TierSizes(host=64), controller_shards=2))
    client = KvrayClient.connect("status-shards", buffer_pages=8)
    try:
        for tenant in range(8):
            keys = client.keys_for_trace([1, 2], salt=f"tenant-{tenant}")
            with client.request(keys) as r:
                r.store()
        runtime.shards.snapshot()  # the commits have landed
        for tenant in range(8):
            keys = client.keys_for_trace([1, 2], salt=f"tenant-{tenant}")
            with client.request(keys) as r:
                assert r.plan.lease == LOCAL_LEASE  # no controller call
        deadline = time.monotonic() + 30
        while runtime.shards.snapshot()["local_lookups"] < 8:  # forwarded by the store, unawaited
            assert time.monotonic() < deadline, "the local requests' reports never reached their shards"
            time.sleep(0.1)
        command = [sys.executable, "-m", "kvray", "status", "--address", ray_cluster.address, "--name", "status-shards"]
        table = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
        as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        client.close()
        runtime.close()
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr[-3000:] + as_json.stderr[-3000:]
    printed = " ".join(table.stderr.split())  # the table goes to the console (stderr)
    assert "controller shards 2" in printed and "kvray controller shards" in printed
    cluster = json.loads(as_json.stdout.strip().splitlines()[-1])["cluster"]
    assert [s["shard"] for s in cluster["shards"]] == [0, 1]
    assert cluster["indexed_pages"] == 16 == sum(s["indexed_pages"] for s in cluster["shards"])
    assert all(s["indexed_pages"] > 0 for s in cluster["shards"])  # 8 roots spread over both
    assert cluster["lookups"] == 8 and cluster["local_lookups"] == 8
    assert cluster["hit_pages_by_tier"] == {"host": 16}
