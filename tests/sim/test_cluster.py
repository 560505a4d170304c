"""The cluster simulator: the 1-node case replays as the first simulator did, replays are
deterministic for a seed, every byte moved is booked on the links it crosses, cluster
heuristics decide as documented, and the oracle is never worse than Belady."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml

from kvray.core.errors import ConfigError
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy, RequestInfo
from kvray.core.tiers import TIER_LABELS, Tier
from kvray.policy import make_policy
from kvray.policy.cluster import (
    AlwaysPrefetch,
    ClusterView,
    CostRouter,
    LocalFirstRing,
    NodeView,
    PrefetchReplicate,
    ReplicateHot,
    RequestView,
    make_cluster_policy,
)
from kvray.report import ReplayTally, hit_tokens
from kvray.resources import shipped_or_given
from kvray.scenario import DEFAULT_SCENARIO, PrefillQueue, RouterSpec, Scenario, load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.cost import CostModel
from kvray.sim.node import Router, node_capacities, session_of
from kvray.sim.oracle import oracle_replay
from kvray.sim.simulator import Simulator, fast_capacity
from kvray.sim.workloads import WorkloadSpec, generate
from kvray.traces import TraceRequest, full_blocks, next_uses, read_trace

SYNTHETIC = "data/traces/synthetic_trace.jsonl"
FOUR = "simulations/h100-4node-skewed.yaml"
EIGHT = "simulations/h100-8node-hetero.yaml"


def with_fields(name: str, **fields) -> Scenario:
    return Scenario.model_validate({**load_scenario(name).model_dump(), **fields})


def reference_replay(scenario, policy, capacities, trace):
    """The first simulator's rule, written out: per request, load every hit page at its
    tier's modeled rate on the engine, prefill the rest, queue for an engine; moves free."""
    cost = CostModel(scenario)
    manager = CacheManager(capacities, policy, page_nbytes=cost.page_nbytes)
    queue, tally = PrefillQueue(scenario.compute.servers), ReplayTally(scenario.layout.page_tokens)
    tier_cost = cost.tier_cost(manager.slots)
    futures = next_uses(trace) if policy.needs_future else None
    block = scenario.layout.page_tokens
    for i, request in enumerate(trace):
        keys = full_blocks(request.hash_ids, request.input_length, block)
        backlog = queue.backlog_ms(request.timestamp_ms)
        policy.on_request(RequestInfo(keys, backlog, tier_cost, None if futures is None else futures[i]))
        match = manager.lookup(keys)
        load = sum(cost.load_ms(Tier(int(t))) for t in match.tiers)
        prefill = cost.prefill_ms(request.input_length - hit_tokens(request, len(match), block))
        wait = queue.serve(request.timestamp_ms, load + prefill)
        manager.touch(match.handles)
        manager.promote(match.handles, lambda *move: None)
        manager.store_chain(keys, lambda *move: None, tenant=session_of(request))
        tally.record(request, [TIER_LABELS[int(t)] for t in match.tiers], wait + load + prefill)
    return tally, manager


@pytest.mark.parametrize("scenario_name", ["h100-llama8b", "h100-llama8b-cluster"])
@pytest.mark.parametrize("policy", ["lru", "arc", "belady", "threshold"])
def test_one_node_replays_as_the_first_simulator(scenario_name, policy):
    scenario = load_scenario(scenario_name)
    trace = read_trace(SYNTHETIC, limit=200)
    capacities = fast_capacity(scenario, trace, fraction=0.05)
    tally, manager = reference_replay(scenario, make_policy(policy), capacities, trace)
    sim = Simulator(scenario, make_policy(policy), capacities)
    result = sim.replay(trace)
    assert result.hit_tokens_by_tier == dict(sorted(tally.hit_by_tier.items()))
    assert np.allclose(sim_ttfts(scenario, policy, capacities, trace), tally.ttft_ms, rtol=1e-9)
    assert result.bytes_moved == manager.metrics.bytes_moved > 0


def sim_ttfts(scenario, policy, capacities, trace):
    sim = Simulator(scenario, make_policy(policy), capacities)
    futures = next_uses(trace) if sim.policy.needs_future else None
    return [sim.serve(r, None if futures is None else futures[i])[1] for i, r in enumerate(trace)]


def test_replays_are_deterministic_for_a_seed_and_the_seed_matters(tmp_path):
    scenario = load_scenario(FOUR)
    trace = generate(WorkloadSpec(sessions=60, session_rate_per_s=20.0), seed=3)
    caps = node_capacities(scenario, trace, 0.05)

    def run(s):
        return ClusterSimulator(s, "lecar", make_cluster_policy("cost-router"), caps).replay(trace).as_dict()

    assert run(scenario) == run(scenario)
    reseeded = scenario.model_copy(update={"router": RouterSpec(kind="sticky", skew=1.2, seed=1)})
    assert run(reseeded) != run(scenario)


def test_sticky_router_keeps_sessions_and_skews_load():
    router = Router(RouterSpec(kind="sticky", skew=1.2), nodes=4)
    landed = [router.land(f"{i}/{i + 1}") for i in range(4000)]
    assert landed[:50] == [router.land(f"{i}/{i + 1}") for i in range(50)]
    counts = np.bincount(landed, minlength=4)
    assert counts[0] > counts[1] > counts[2] > counts[3] > 0
    assert counts[0] / 4000 == pytest.approx(1 / sum((i + 1) ** -1.2 for i in range(4)), abs=0.03)
    robin = Router(RouterSpec(kind="round-robin"), nodes=3)
    assert [robin.land("s") for _ in range(5)] == [0, 1, 2, 0, 1]
    assert Router(RouterSpec(kind="none"), nodes=3).land("s") is None


def test_every_byte_moved_is_booked_on_the_links_it_crosses():
    scenario = with_fields("h100-llama8b", links={"queued": True})
    trace = read_trace(SYNTHETIC, limit=400)
    sim = Simulator(scenario, make_policy("lru"), fast_capacity(scenario, trace, fraction=0.05))
    sim.replay(trace)
    node, nbytes = sim.node, scenario.layout.page_nbytes
    booked = {kind: sum(link.bytes_by_kind.get(kind, 0) for link in node.links) for kind in ("demote", "promote", "load")}
    moves = 0
    for move, pages in node.manager.metrics.moved_pages.items():
        src, dst = (Tier[label.upper()] for label in move.split("->"))
        moves += pages * nbytes * len(node.move_path[src, dst])
    assert moves > 0 and booked["demote"] + booked["promote"] == moves
    loads = sum(n * nbytes * len(node.load_path[Tier[t.upper()]]) for t, n in node.manager.metrics.hit_pages.items())
    assert loads > 0 and booked["load"] == loads
    # one host tier only: every stored page crosses PCIe device-to-host once
    host_only = load_scenario("reference-single-tier")
    sim = Simulator(host_only, make_policy("lru"), fast_capacity(host_only, trace, fraction=0.05))
    sim.replay(trace)
    assert sim.node.d2h.bytes_by_kind["store"] == sim.manager.metrics.stored_pages * nbytes > 0


def test_cross_node_loads_cross_both_nics_and_the_switch():
    scenario = load_scenario(FOUR)
    trace = generate(WorkloadSpec(sessions=80, session_rate_per_s=20.0, document_probability=0.8, system_prompt_pages=1), seed=5)
    sim = ClusterSimulator(scenario, "lru", make_cluster_policy("cost-router"), node_capacities(scenario, trace, 0.1))
    result = sim.replay(trace)
    remote_pages = result.hit_tokens_by_tier.get("remote", 0) // scenario.layout.page_tokens
    nbytes = scenario.layout.page_nbytes
    nic_in = sum(n.nic_in.bytes_by_kind.get("load", 0) for n in sim.nodes)
    nic_out = sum(n.nic_out.bytes_by_kind.get("load", 0) for n in sim.nodes)
    assert remote_pages > 0 and nic_in == nic_out == sim.switch.bytes_by_kind["load"] == remote_pages * nbytes
    assert set(result.extra["link_utilisation"]) <= set(result.extra["link_bytes"])
    assert result.p99_ttft_ms >= result.mean_ttft_ms > 0


def test_prefetch_overlaps_the_queue_wait():
    scenario = with_fields("h100-llama8b", compute={"prefill_us_per_token": 35, "servers": 1})
    warm = TraceRequest(0.0, 4096, 1, tuple(range(8)))
    busy = TraceRequest(1e6, 65536, 1, tuple(range(100, 228)))  # holds the one engine for ~2.3 s
    again = TraceRequest(1e6 + 1, 4096 + 100, 1, tuple(range(8)) + (999,))
    ttfts = {}
    for policy in (LocalFirstRing(), AlwaysPrefetch()):
        sim = ClusterSimulator(scenario, "threshold", policy)  # threshold admits to host: loads cross PCIe
        for request in (warm, busy):
            sim.serve(request)
        hits, ttfts[policy.name] = sim.serve(again)
        assert hits == ["host"] * 8
    load = 8 * sim.nodes[0].cost.load_ms(Tier.HOST)
    assert ttfts["local-first"] - ttfts["always-prefetch"] == pytest.approx(load)


def test_views_report_the_modeled_queues_links_and_tiers():
    scenario = load_scenario(FOUR)
    trace = generate(WorkloadSpec(sessions=40, session_rate_per_s=20.0), seed=2)
    sim = ClusterSimulator(scenario, "lru", LocalFirstRing(), node_capacities(scenario, trace, 0.05))
    for request in trace[:-1]:
        sim.serve(request)
    last = trace[-1]
    request, cluster = sim.views(last, node="node-1")
    assert request.requester == "node-1" and request.session == session_of(last)
    assert request.keys == tuple(full_blocks(last.hash_ids, last.input_length, scenario.layout.page_tokens))
    assert all(n in sim.names for n in request.hit_nodes)
    assert cluster.names == ["node-0", "node-1", "node-2", "node-3"]
    node = sim.nodes[1]
    view = cluster.node("node-1")
    assert view.backlog_ms == node.queue.backlog_ms(last.timestamp_ms)
    host = node.manager.slots[Tier.HOST]
    assert view.free_share["host"] == pytest.approx(1 - host.used / host.capacity)
    assert view.disk_write_util == node.nvme_write.utilisation(last.timestamp_ms)
    assert cluster.page_prefill_ms == pytest.approx(512 * 0.035)


def test_cost_router_weighs_overlap_against_load():
    view = ClusterView((NodeView("a", backlog_ms=10.0), NodeView("b")), page_prefill_ms=20.0)
    request = RequestView(keys=(1, 2, 3), requester="b", hit_nodes=("a", "a"))
    assert CostRouter().route(request, view) == "a"  # 10 + 20 x 1 < 20 x (1 + 0.5 x 2)
    loaded = ClusterView((NodeView("a", backlog_ms=30.0), NodeView("b")), page_prefill_ms=20.0)
    assert CostRouter().route(request, loaded) == "b"  # 50 > 40
    tie = ClusterView((NodeView("a"), NodeView("b")), page_prefill_ms=20.0)
    assert CostRouter().route(RequestView(keys=(1,), requester="b"), tie) == "b"
    # a measured fetch price replaces the 0.5-page guess: 2 ms a page fetched, so b's 15 + 20 + 4 < a's 30 + 20
    measured = ClusterView((NodeView("a", backlog_ms=30.0), NodeView("b", backlog_ms=15.0)), 20.0, page_fetch_ms=2.0)
    assert CostRouter().route(request, measured) == "b"
    assert CostRouter().route(request, replace(measured, page_fetch_ms=0.0)) == "a"  # unknown: 50 < 15 + 20 + 20


def test_replicate_hot_copies_to_the_reader_after_the_threshold():
    view = ClusterView((NodeView("a"), NodeView("b")))
    policy = ReplicateHot(threshold=3)
    request = RequestView(keys=(1, 2), requester="b", hit_nodes=("a", "b"))
    assert [policy.replicate(request, view) for _ in range(4)] == [[], [], ["b"], ["b"]]
    assert policy.replicate(RequestView(keys=(1, 2), requester="b", hit_nodes=("b", "b")), view) == []
    assert PrefetchReplicate(prefetch=False, threshold=None).replicate(request, view) == []


def test_replication_copies_hot_chains_in_the_simulator():
    scenario = load_scenario(FOUR)
    trace = generate(WorkloadSpec(sessions=80, session_rate_per_s=20.0, document_probability=0.8, system_prompt_pages=1), seed=5)
    caps = node_capacities(scenario, trace, 0.1)
    plain = ClusterSimulator(scenario, "lru", LocalFirstRing(), caps).replay(trace)
    hot = ClusterSimulator(scenario, "lru", ReplicateHot(threshold=2), caps).replay(trace)
    replicated = sum(v for k, v in hot.extra["link_bytes"].items() if k.endswith("nic_in"))
    assert replicated > 0
    assert hot.hit_tokens_by_tier.get("remote", 0) < plain.hit_tokens_by_tier.get("remote", 0)


def test_oracle_is_never_worse_than_belady():
    scenario = load_scenario(FOUR)
    trace = generate(WorkloadSpec(sessions=60, session_rate_per_s=20.0, document_probability=0.6), seed=4)
    caps = node_capacities(scenario, trace, 0.05)
    belady = ClusterSimulator(scenario, "belady", LocalFirstRing(), caps).replay(trace)
    oracle = oracle_replay(trace, scenario, caps)
    assert oracle.mean_ttft_ms <= belady.mean_ttft_ms
    assert oracle.extra["oracle_search"]["route=front,prefetch=off,replicate=never"] == pytest.approx(belady.mean_ttft_ms)
    assert len(oracle.extra["oracle_search"]) == 12 and oracle.policy == "oracle"


def test_a_policy_is_told_the_queue_of_its_queued_links_and_none_of_unqueued_ones():
    """``RequestInfo.load_util`` is what a transfer would queue behind: the busy share of a
    cluster scenario's queued links, 0 on a single-node scenario's unqueued ones however busy."""
    seen: list[float] = []

    class Recording(LRUPolicy):
        needs_link_util = True

        def on_request(self, info: RequestInfo) -> None:
            super().on_request(info)
            seen.append(info.load_util[Tier.DISK])

    trace = generate(WorkloadSpec(sessions=60, session_rate_per_s=20.0, document_probability=0.6), seed=4)
    scenario = load_scenario(FOUR).with_bandwidth(0.5)
    ClusterSimulator(scenario, Recording, LocalFirstRing(), node_capacities(scenario, trace, 0.05)).replay(trace)
    assert max(seen) > 0
    seen.clear()
    one = load_scenario(DEFAULT_SCENARIO).with_bandwidth(0.05)  # its unqueued disk busy: over half the time
    result = Simulator(one, Recording(), fast_capacity(one, trace, fraction=0.05)).replay(trace)
    busy = {k.rsplit("/", 1)[-1]: v for k, v in result.extra["link_utilisation"].items()}
    assert busy["nvme_read"] > 0.46 and busy["nvme_write"] > 1 and set(seen) == {0.0}


def test_selective_write_spares_the_nvme():
    scenario = load_scenario(EIGHT)
    trace = read_trace(SYNTHETIC, limit=400)
    caps = node_capacities(scenario, trace, 0.05)
    results = {p: ClusterSimulator(scenario, p, LocalFirstRing(), caps).replay(trace) for p in ("lru", "selective-write")}

    def nvme_writes(result):
        return sum(v for k, v in result.extra["link_bytes"].items() if k.endswith("nvme_write"))

    assert nvme_writes(results["selective-write"]) < nvme_writes(results["lru"]) / 2


def test_cluster_scenarios_are_validated(tmp_path):
    spec = yaml.safe_load(shipped_or_given(FOUR, "simulations", ".yaml").read_text())
    spec["nodes"] = [{"name": "a"}, {"name": "a"}]
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="unique"):
        load_scenario(path)
    spec["nodes"] = [{"name": "a", "tiers": {"remote": {"capacity_pages": 1, "read_gbps": 1, "write_gbps": 1}}}]
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="remote"):
        load_scenario(path)
    with pytest.raises(ConfigError, match="several nodes"):
        Simulator(load_scenario(FOUR), make_policy("lru"))
    scenario = load_scenario(EIGHT)
    names = [n.name for n in scenario.node_scenarios()]
    assert names == ["large-0", "large-1"] + [f"small-{i}" for i in range(6)]
    caps = node_capacities(scenario, read_trace(SYNTHETIC, limit=200), pages=1000)
    assert sum(c[Tier.DEVICE] + c[Tier.HOST] for c in caps) == pytest.approx(1000, abs=8)
    assert caps[0][Tier.HOST] > caps[2][Tier.HOST]  # large nodes get their larger share
