"""The concurrency benchmark at a tiny size on the three test nodes: every level serves
every request with no wrong page and no call given up, the controller's counters agree
with the clients', requests really overlap, and 2 controller shards both serve lookups."""

from __future__ import annotations

import json

import pytest

from kvray.bench.concurrency import DEPTH, results_of, run_concurrency, write_report

pytestmark = [pytest.mark.ray]


@pytest.mark.timeout(1200)  # ~80 s on a quiet machine; it starts ~20 client processes, which took over 600 s under load
def test_the_concurrency_bench_serves_every_request_right_at_a_tiny_size(ray_cluster, tmp_path, monkeypatch):
    report = run_concurrency(levels=(1, 3), shard_counts=(1, 2), requests=36, agents=6, sessions=2, lookups=240)
    monkeypatch.setenv("KVRAY_BENCH_OUT", str(tmp_path))
    written = write_report(report)

    for run in (*report["levels"], report["serial"]):
        assert run["requests"] == 36 and run["wrong_pages"] == 0 and run["faults"] == 0
        assert run["counters_consistent"], run
        assert run["hit_pages"] > 0  # the agents' shared prompts were found again
    assert report["serial"]["in_flight_peak"] == 1
    assert 1 < report["levels"][-1]["in_flight_peak"] <= 3 * DEPTH
    one, two = report["lookups_by_shards"]
    assert sum(one["lookups_by_shard"]) >= 240 and len(two["lookups_by_shard"]) == 2
    assert min(two["lookups_by_shard"]) > 0  # both shards own some of the agents' chains
    assert json.loads(written.read_text())["levels"][0]["clients"] == 1
    assert (tmp_path / "concurrency.png").stat().st_size > 0
    names = [r.name for r in results_of(report)]
    assert "concurrency_throughput[3 clients]" in names and "concurrency_lookup_throughput[2 shards]" in names
