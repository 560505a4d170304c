"""The cluster policy's NVMe write budget in the simulator (kvray/sim/cluster.py): each node
writes to its disk tier only what the budget pays for, on its modeled clock, by the rule a
node's store enforces (kvray/core/write_budget.py; tests/core/test_write_budget.py)."""

from __future__ import annotations

import pytest

from kvray.core.errors import ConfigError
from kvray.core.write_budget import BURST_S
from kvray.policy.cluster import LocalFirstRing
from kvray.scenario import load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.sim.workloads import WorkloadSpec, generate

RATE = 5e8  # bytes/s: a tenth of what the busiest node's drive takes here unbudgeted


class Budgeted(LocalFirstRing):
    name = "budgeted"

    def __init__(self, rate: float | None) -> None:
        super().__init__()
        self.rate = rate

    def disk_write_budget(self, node, cluster):
        return self.rate


def replay(rate) -> ClusterSimulator:
    scenario = load_scenario("simulations/h100-4node-skewed.yaml")
    trace = generate(WorkloadSpec(sessions=40, session_rate_per_s=20.0), seed=2)
    sim = ClusterSimulator(scenario, "lru", Budgeted(rate), node_capacities(scenario, trace, 0.05))
    for request in trace:
        sim.serve(request)
    return sim


def written(sim: ClusterSimulator) -> list[int]:
    return [sum(node.nvme_write.bytes_by_kind.values()) for node in sim.nodes]


def test_each_node_writes_to_disk_only_what_its_budget_paid_for():
    free, capped = replay(None), replay(RATE)
    assert all(node.manager.disk_budget is None for node in free.nodes)
    for node, nbytes in zip(capped.nodes, written(capped)):
        budget = node.manager.disk_budget
        if budget is None:  # a node that never served a request was never given one
            assert nbytes == 0
            continue
        assert nbytes == budget.taken_bytes  # every byte booked on the drive was paid for
        assert nbytes <= RATE * (node.clock / 1e3 + BURST_S)
    assert sum(written(capped)) < 0.6 * sum(written(free))
    assert any(node.manager.disk_budget and node.manager.disk_budget.refused_pages for node in capped.nodes)


def test_a_budget_that_is_not_a_rate_is_refused_by_name():
    with pytest.raises(ConfigError, match="disk write budget"):
        replay(-1.0)


def test_on_a_shared_channel_writes_delay_the_loads_and_a_budget_buys_them_back():
    """A drive whose reads and writes take turns (``shared_channel``): the same replay hits
    the same pages (the policies decide alike) but waits longer for them, the drive's channel
    booked with every byte read and written; a write budget shortens the wait again."""
    scenario = load_scenario("simulations/h100-4node-skewed.yaml")
    shared = scenario.with_shared_disk()
    assert shared.name.endswith("@shared-disk") and shared.tiers["disk"].shared_channel
    trace = generate(WorkloadSpec(sessions=40, session_rate_per_s=20.0), seed=2)
    caps = node_capacities(scenario, trace, 0.05)
    apart, together, budgeted = (
        ClusterSimulator(s, "lru", Budgeted(rate), caps).replay(trace)
        for s, rate in ((scenario, None), (shared, None), (shared, RATE))
    )
    assert together.hit_tokens == apart.hit_tokens and together.mean_ttft_ms > apart.mean_ttft_ms
    assert budgeted.mean_ttft_ms < together.mean_ttft_ms
    sim = ClusterSimulator(shared, "lru", Budgeted(None), caps)
    sim.replay(trace)
    drives = [[link for link in node.links if link.name.endswith("/nvme")] for node in sim.nodes]
    assert all(len(d) == 1 for d in drives)
    booked = [d[0].bytes for d in drives]
    assert booked == [node.nvme_read.bytes + node.nvme_write.bytes for node in sim.nodes] and min(booked[:2]) > 0


def test_only_a_disk_tier_takes_a_shared_channel():
    from kvray.scenario import Scenario

    spec = load_scenario("simulations/h100-4node-skewed.yaml").model_dump()
    spec["tiers"]["host"]["shared_channel"] = True
    with pytest.raises(ValueError, match="tier\\(s\\) host cannot take it, only disk"):
        Scenario.model_validate(spec)
