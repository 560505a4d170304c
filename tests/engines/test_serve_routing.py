"""kvray's Serve router's replica choice (kvray.engines.vllm.routing), on hand-built
candidates: pure, no Ray. The live router is tested in a real Serve deployment
(tests/engines/test_vllm_serve.py)."""

from __future__ import annotations

import pytest

from kvray.core.errors import PolicyError
from kvray.core.keys import ModelFingerprint, page_keys
from kvray.engines.vllm.routing import (
    Candidate,
    EngineCaches,
    choose_replica,
    fingerprint_stats,
    keys_from_stats,
    least_loaded,
)
from kvray.policy.cluster import (
    ClusterPolicy,
    ClusterView,
    CostRouter,
    LocalFirstRing,
    NodeView,
    RequestView,
    make_cluster_policy,
)
from tests.conftest import TINY

KEYS = tuple(range(10))
REPLICAS = [Candidate("r-a", "node-a", 0), Candidate("r-b", "node-b", 0)]


def test_a_cached_prefix_goes_to_the_replica_on_the_node_holding_it():
    assert choose_replica(CostRouter(), KEYS, ["node-b"] * 8, REPLICAS, request_ms=50.0, page_prefill_ms=10.0) == "r-b"
    assert choose_replica(CostRouter(), KEYS, ["node-a"] * 8, REPLICAS, request_ms=50.0, page_prefill_ms=10.0) == "r-a"


def test_a_queue_longer_than_the_saved_prefill_sends_the_request_elsewhere():
    busy = [Candidate("r-a", "node-a", 0), Candidate("r-b", "node-b", 3)]
    # node-b: 3 x 50 ms queued + 2 pages; node-a: 2 pages + 8 fetched pages at half weight (10 ms each)
    assert choose_replica(CostRouter(), KEYS, ["node-b"] * 8, busy, request_ms=50.0, page_prefill_ms=10.0) == "r-a"
    assert choose_replica(CostRouter(), KEYS, ["node-b"] * 8, busy, request_ms=5.0, page_prefill_ms=10.0) == "r-b"


def test_link_state_comes_from_the_controller_and_backlog_from_serve():
    seen = []

    class Recording(ClusterPolicy):
        def route(self, request, cluster):
            seen.append((request, cluster))
            return "node-b"

    links = ClusterView((NodeView("node-b", backlog_ms=999.0, nic_in_util=0.7), NodeView("node-z")))
    replicas = [Candidate("r-a", "node-a", 2), Candidate("r-b1", "node-b", 4), Candidate("r-b2", "node-b", 1)]
    assert choose_replica(Recording(), KEYS, ["node-b"], replicas, links, request_ms=10.0, page_prefill_ms=7.0) == "r-b2"
    request, cluster = seen[0]
    assert request.keys == KEYS and request.hit_nodes == ("node-b",) and request.requester == "node-b"
    assert cluster.page_prefill_ms == 7.0 and cluster.names == ["node-a", "node-b"]  # nodes with replicas only
    assert cluster.node("node-a") == NodeView("node-a", backlog_ms=20.0)  # not reported: idle links
    assert cluster.node("node-b").nic_in_util == 0.7 and cluster.node("node-b").backlog_ms == 10.0  # least-loaded replica's


def test_a_policy_that_does_not_route_keeps_the_least_loaded_replica():
    replicas = [Candidate("r-a", "node-a", 1), Candidate("r-b", "node-b", 0)]
    assert least_loaded(replicas).replica == "r-b"
    assert choose_replica(LocalFirstRing(), KEYS, ["node-a"] * 10, replicas) == "r-b"


def test_a_policy_naming_a_node_without_a_replica_is_refused():
    class Elsewhere(ClusterPolicy):
        name = "elsewhere"

        def route(self, request, cluster):
            return "node-z"

    with pytest.raises(PolicyError, match="'elsewhere' routed to node 'node-z'; replicas run on node-a, node-b"):
        choose_replica(Elsewhere(), KEYS, [], REPLICAS)
    with pytest.raises(PolicyError, match="no replica"):
        choose_replica(CostRouter(), KEYS, [], [])


def test_the_router_keys_prompts_as_the_replicas_connector_does():
    fingerprint = ModelFingerprint.of(TINY, "tiny", "rev-1")
    tokens = list(range(3, 23))
    stats = fingerprint_stats(fingerprint, "tenant-a")
    assert keys_from_stats(tokens, stats) == page_keys(tokens, fingerprint, "tenant-a")
    assert keys_from_stats(tokens, stats) != page_keys(tokens, fingerprint, "")


def test_a_learned_route_serves_here_unchanged_on_the_views_the_controller_gives():
    """rl-router (the shipped PPO weights) picks through the router what it picks when asked
    directly, on the view with the hit pages' tiers the controller reports; the backlog
    Serve shows can move it off the node holding the prefix, as in the simulator."""
    hit_nodes, tiers = ["node-b"] * 8, ["host"] * 8
    for queues in ((0, 0), (0, 6), (6, 0)):
        replicas = [Candidate("r-a", "node-a", queues[0]), Candidate("r-b", "node-b", queues[1])]
        routed = choose_replica(make_cluster_policy("rl-router"), KEYS, hit_nodes, replicas, None, 40.0, 5.0, tiers)
        nodes = (NodeView("node-a", backlog_ms=queues[0] * 40.0), NodeView("node-b", backlog_ms=queues[1] * 40.0))
        front = "node-a" if queues[0] <= queues[1] else "node-b"
        view = RequestView(KEYS, front, tuple(hit_nodes), hit_tiers=tuple(tiers))
        direct = make_cluster_policy("rl-router").route(view, ClusterView(nodes, 5.0))
        assert routed == {"node-a": "r-a", "node-b": "r-b"}[direct]


def test_the_engines_own_caches_count_as_their_nodes_device_pages_until_evicted():
    """What a router sent a node stays in that engine's own cache (LRU, ``capacity_pages``):
    a session's next turn sees its history on that node's device tier, even where the
    runtime placed the pages elsewhere; once other prompts pushed it out, the runtime's
    answer stands."""
    caches = EngineCaches(capacity_pages=4)
    caches.served("node-a", [1, 2, 3])
    nodes, tiers = caches.merge([1, 2, 3, 4], ["node-b", "node-b"])
    assert nodes == ["node-a"] * 3 and tiers == ("device",) * 3  # longer than the runtime's prefix: extended
    assert choose_replica(CostRouter(), [1, 2, 3, 4], nodes, REPLICAS, page_prefill_ms=10.0, hit_tiers=tiers) == "r-a"
    caches.served("node-b", [1, 2])  # both hold the root: the runtime's node wins the tie
    assert caches.merge([1, 2, 9], ["node-b", "node-b"]) == (["node-b", "node-b"], ("device", "device"))
    caches.served("node-a", [7, 8, 9])  # node-a keeps 4 pages: the two oldest (1, 2) leave
    assert caches.prefix("node-a", [1, 2, 3]) == 0
    assert caches.merge([5, 6], ["node-b"]) == (["node-b"], ())  # no engine holds it: the runtime's answer
    assert caches.merge([5, 6], ["node-b"], ["disk"]) == (["node-b"], ("disk",))  # with the tiers it names
    caches.served("node-a", [5])
    assert caches.merge([5, 6], ["node-b", "node-b"], ["host", "disk"]) == (["node-a", "node-b"], ("device", "disk"))
