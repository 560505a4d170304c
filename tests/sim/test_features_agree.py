"""One policy, two worlds: for the same requests (a trace prefix, the same capacities, a
quiet cluster) a policy sees the same observations in the Ray runtime as in the simulator.

The runtime's controller and stores run recording policies (``tests.sim.recording``,
built by import path in their actors), which write down every ``place`` (RequestView,
pages to place, ClusterView) and every ``on_request`` (RequestInfo) they are shown. The
simulator's side: the single-node :class:`~kvray.sim.simulator.Simulator` for the
RequestInfo of one node, and :class:`tests.sim.cluster_reference.ClusterReference` (the
runtime's cluster rules over modeled nodes, standing in for the cluster simulator until it
merges) for the views of one and two nodes. Keys are compared as the runtime makes them:
the simulator's trace block ids bound to the model (:func:`~kvray.core.keys.trace_page_keys`).

The cluster verbs (route, load-or-recompute, prefetch, replicate) are compared with the
cluster simulator itself (:class:`~kvray.sim.cluster.ClusterSimulator` on
``simulations/this-machine-runtime-3node.yaml`` cut to two nodes): a recording policy that
decides every verb from what both worlds show alike runs in the runtime's controller
(``Controller.decide``, executed by the replay's engines) and in the simulator, and both
must show its ``route`` the same views, end with the same hits, and copy the same pages
to the same nodes. On all three nodes a policy replicates to nodes that neither serve a
request nor hold its pages: the copies land where the simulator puts them and read back exact.

Quiet means nothing else runs and each request starts after the last one's reports
landed (the replay's engines settle between requests); link utilisations are read over a
1 microsecond window, so the runtime sees idle links as the simulator does (their
measurement over longer windows is tested in tests/cluster/test_observe.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import ray

from kvray.apps.replay import replay_on_runtime, replay_with, settings_from
from kvray.cluster.checked import PagePattern
from kvray.cluster.runtime import Runtime, alive_nodes
from kvray.core.keys import trace_page_keys
from kvray.core.placement import RequestInfo
from kvray.policy.cluster import ClusterView, NodeView, RequestView
from kvray.scenario import NodeSpec, load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.simulator import Simulator
from kvray.traces import read_trace
from tests.conftest import extra_nodes
from tests.sim.cluster_reference import ClusterReference
from tests.sim.recording import (
    RecordingLRU,
    RecordingRing,
    RecordingVerbs,
    RecordingVerbsElsewhere,
    clear_records,
    read_records,
)

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "simulations" / "this-machine-runtime.yaml"
TRACE = ROOT / "data" / "traces" / "synthetic_trace.jsonl"
CLUSTER = ROOT / "simulations" / "this-machine-runtime-3node.yaml"
CONVERSATION = ROOT / "data" / "traces" / "conversation_trace_first30min.jsonl"  # shared prefixes: hits on every node
REQUESTS = 120
SOLO = {"kvray_views_solo": 1.0}  # one of the two nodes
PAIR = {"kvray_views": 1.0}  # two of the three
TRIO = {"kvray_views_trio": 1.0}  # all three


@pytest.fixture(scope="module")
def extra_store_nodes(ray_cluster):
    """Three store nodes of their own: one offers SOLO, PAIR and TRIO, one PAIR and TRIO, one TRIO."""
    with extra_nodes(ray_cluster, PAIR | SOLO | TRIO, PAIR | TRIO, TRIO):
        yield


def recorded_run(name: str, resources: dict, local_pages_limit: int | None = None):
    """Replay the trace prefix on the runtime with recording policies; (settings, result,
    place records, on_request records per store)."""
    clear_records()
    runtime = {
        "name": name,
        "policy": "tests.sim.recording:RecordingLRU",
        "cluster_policy": "tests.sim.recording:RecordingRing",
        "store_resources": resources,
        "observe_window_s": 1e-6,
        "local_pages_limit": local_pages_limit,
    }
    settings = settings_from(SCENARIO, runtime, {}, {"prefill_us_per_token": 0.0})  # views only: no prefill compute
    result = replay_on_runtime(read_trace(TRACE, limit=REQUESTS), settings, progress=False).as_dict()
    assert result["wrong_pages"] == 0
    (places,) = read_records("place")  # one controller
    return settings, result, places, read_records("on_request")


def reference_run(settings, nodes: list[str]) -> ClusterReference:
    reference = ClusterReference(nodes, settings.runtime, RecordingRing())
    reference.policy.sink = None
    for manager in reference.nodes.values():
        manager.policy.sink = None  # this process's records stay in memory
    for i, request in enumerate(read_trace(TRACE, limit=REQUESTS)):
        reference.serve(i, request)
    return reference


def _first_keys(seen: list[RequestInfo]) -> tuple:
    """Orders the nodes' records by their first request (the runtime's stores are unnamed)."""
    return seen[0].keys if seen else ()


def assert_same_views(settings, result, places, infos, reference: ClusterReference) -> None:
    assert places and places == reference.policy.seen
    expected = sorted((m.policy.seen for m in reference.nodes.values()), key=_first_keys)
    assert sorted(infos, key=_first_keys) == expected
    assert {k: v for k, v in result["hit_tokens_by_tier"].items() if v} == {
        tier: pages * 512 for tier, pages in reference.hit_pages_by_tier.items() if pages
    }


def test_one_node_the_runtime_shows_the_policies_what_the_simulator_does(extra_store_nodes):
    settings, result, places, infos = recorded_run("views-one", SOLO)
    node = places[0][2].names
    assert len(node) == 1
    reference = reference_run(settings, node)
    assert_same_views(settings, result, places, infos, reference)
    # The single-node simulator tells its policy the same of every request (keys made the
    # runtime's way; a request without a full page never reaches the runtime's cache).
    trace = read_trace(TRACE, limit=REQUESTS)
    policy = RecordingLRU()
    policy.sink = None
    simulator = Simulator(load_scenario(SCENARIO), policy)
    simulator.replay(trace)
    fingerprint = settings.runtime.fingerprint()
    simulated = [replace(info, keys=tuple(trace_page_keys(fingerprint, info.keys))) for info in policy.seen if info.keys]
    assert infos == [simulated]
    assert simulated[0].page_prefill_ms == settings.runtime.page_prefill_ms > 0  # both weigh modeled time
    assert simulated[0].tier_cost == settings.runtime.tier_costs() and simulated[0].backlog_ms == 0.0
    assert any(view.free_share["host"] < 1.0 for _, _, cluster in places for view in cluster.nodes)


def test_two_nodes_the_runtime_shows_the_policies_what_the_reference_does(extra_store_nodes):
    # Requests over 8 pages are spread by the ring, so pages cross nodes both ways.
    settings, result, places, infos = recorded_run("views-two", PAIR, local_pages_limit=8)
    nodes = places[0][2].names
    assert len(nodes) == 2 and len(infos) == 2
    assert result["hit_tokens_by_tier"].get("remote", 0) > 0
    assert_same_views(settings, result, places, infos, reference_run(settings, nodes))


def _as_runtime(request: RequestView, cluster: ClusterView, nodes: dict[str, str], fingerprint: bytes) -> tuple:
    """A simulator's route views in the runtime's terms: keys bound to the model, node
    names by membership order, no session (the runtime's front end has none), floats to 12
    digits (a free share is 1 - used/capacity in one world, free/capacity in the other)."""
    req = RequestView(
        tuple(trace_page_keys(fingerprint, request.keys)),
        nodes[request.requester],
        tuple(nodes[n] for n in request.hit_nodes),
        hit_tiers=request.hit_tiers,
    )
    return req, _rounded(ClusterView(tuple(replace(n, name=nodes[n.name]) for n in cluster.nodes), cluster.page_prefill_ms))


def _rounded(cluster: ClusterView) -> ClusterView:
    def node(n: NodeView) -> NodeView:
        floats = {f: round(getattr(n, f), 12) for f in ("backlog_ms", "nic_in_util", "nic_out_util", "pcie_util")}
        disk = {f: round(getattr(n, f), 12) for f in ("disk_read_util", "disk_write_util")}
        return replace(n, free_share={t: round(v, 12) for t, v in n.free_share.items()}, **floats, **disk)

    return ClusterView(tuple(node(n) for n in cluster.nodes), cluster.page_prefill_ms)


def verbs_replay(name: str, resources: dict, nodes: int, cluster_policy: type, tcp: bool = True, check=None) -> tuple:
    """The conversation prefix replayed by the runtime on the ``resources`` nodes and by the
    cluster simulator on ``simulations/this-machine-runtime-3node.yaml`` cut to ``nodes``,
    both under ``cluster_policy`` (a recording one, by import path in the controller);
    ``check(runtime, settings)`` runs on the runtime once the replay is done. Returns the
    runtime's result, route and ``placed`` records, the simulator, its policy and result,
    the simulator's node names by runtime node, and the trace."""
    clear_records()
    runtime = {
        "name": name,
        "tcp": tcp,
        "policy": "tests.sim.recording:RecordingPlaces",
        "cluster_policy": f"tests.sim.recording:{cluster_policy.__name__}",
        "store_resources": resources,
        "observe_window_s": 1e-6,
    }
    settings = settings_from(CLUSTER, runtime, {}, {"prefill_us_per_token": 0.0})
    trace = read_trace(CONVERSATION, limit=60)
    members = alive_nodes(resources)  # the runtime's membership order, which the front end goes round
    started = Runtime.start(settings.runtime)
    try:
        result = replay_with(started, trace, settings, progress=False).as_dict()
        if check is not None:
            check(started, settings)
    finally:
        started.close()
    assert result["wrong_pages"] == 0
    (routes,) = read_records("route")  # one controller
    placed = read_records("placed")  # one list per store

    scenario = load_scenario(CLUSTER).model_copy(update={"nodes": [NodeSpec(name="node", count=nodes)]})
    policy = cluster_policy()
    policy.sink = None
    simulator = ClusterSimulator(scenario, "tests.sim.recording:RecordingPlaces", policy)
    for node in simulator.nodes:
        node.policy.sink = None
    simulated = simulator.replay(trace).as_dict()
    names = dict(zip([f"node-{i}" for i in range(nodes)], members))
    fingerprint = settings.runtime.fingerprint()
    expected = [_as_runtime(request, cluster, names, fingerprint) for request, cluster in policy.seen if request.keys]
    assert [(request, _rounded(cluster)) for request, cluster in routes] == expected
    assert result["hit_tokens_by_tier"] == simulated["hit_tokens_by_tier"] and result["hit_tokens"] > 0
    return result, placed, simulator, simulated, names, trace, fingerprint


@pytest.mark.parametrize("tcp", [True, False])  # pages between nodes by the page server, or Ray's object store
def test_the_runtime_executes_every_cluster_verb_as_the_simulator_does(extra_store_nodes, tcp):
    result, placed, simulator, simulated, names, trace, fingerprint = verbs_replay(
        f"verbs-two-{tcp}", PAIR, 2, RecordingVerbs, tcp
    )
    verbs = result["cluster_verbs"]
    assert min(verbs["routed_elsewhere"], verbs["load_splits"], verbs["prefetches"], verbs["replications"]) > 0, verbs
    assert verbs["budget_changes"] > 0, verbs
    # each world reports what the node policies counted (PlacementPolicy.stats), summed over the nodes:
    # the pages they admitted and the requests they were told of, a node whose pages another node
    # reads included (the runtime's page server hears of the request with the read)
    for counted in ("pages_admitted", "requests_told"):
        assert result["policy_stats"][counted] == simulated["policy_stats"][counted] > 0, counted
    # and each node hears of the same requests (by arrival), in the same order
    told = [[r for r in records if r[0] == "request"] for records in placed]
    expected_told = [[r for r in node.policy.seen if r[0] == "request"] for node in simulator.nodes]
    assert sorted(told) == sorted(expected_told)
    assert sum(map(len, expected_told)) > len(trace)  # some requests were told to a second node
    # Each node's policy is told each page's depth in its request and the request's length,
    # and requests at the trace's arrival times, as in the simulator (a per-page policy reads
    # them as features: with run-relative depths and wall-clock arrivals, reuse's hits ran
    # 1.063x the simulator's on 3 nodes; docs/sim-eval, "The per-page learned policy on the runtime")
    assert_same_pages(placed, simulator, trace, fingerprint)
    arrivals = {r.timestamp_ms for r in trace}
    assert all(r[1] in arrivals for records in placed for r in records if r[0] == "request")
    assert verbs["replicated_pages_by_node"] == {names[n]: pages for n, pages in simulator.replicated_pages.items()}


def assert_same_pages(placed, simulator: ClusterSimulator, trace, fingerprint: bytes) -> None:
    """Each node's policy admitted the same pages (key, depth, request length), in the same
    order, in both worlds; and some page sits past its chain's root."""
    bound = {k: trace_page_keys(fingerprint, [k])[0] for r in trace for k in r.hash_ids}
    expected_pages = [[("page", bound[r[1]], *r[2:]) for r in node.policy.seen if r[0] == "page"] for node in simulator.nodes]
    runtime_pages = [[r for r in records if r[0] == "page"] for records in placed]
    assert sorted(runtime_pages, key=lambda pages: pages[:1]) == sorted(expected_pages, key=lambda pages: pages[:1])
    assert any(depth > 0 for pages in expected_pages for _, _, depth, _ in pages)


def test_the_runtime_replicates_to_a_third_node_as_the_simulator_does(extra_store_nodes):
    """``replicate`` naming nodes that neither serve the request nor hold its pages: the
    runtime copies the cached prefix there (from the serving node's landing buffer, over
    the page servers) and tells their stores of the request; the pages land on the node the
    simulator puts them on, as many, read back exact, and every view and hit agrees."""
    read_back: dict[str, int] = {}

    def every_page_held_reads_back_exact(runtime: Runtime, settings) -> None:
        pattern = PagePattern(settings.runtime.layout.page_nbytes)
        for node, store in runtime.stores.items():
            keys = [key for key, _ in ray.get(store.holdings.remote(), timeout=60)["pages"]]
            for i in range(0, len(keys), 16):  # 1 MiB pages: a few at a time through the object store
                chunk = keys[i : i + 16]
                rows = ray.get(store.get_pages.remote(chunk), timeout=60)
                assert len(rows) == len(chunk) and pattern.wrong(chunk, rows) == 0
            read_back[node] = len(keys)

    result, placed, simulator, simulated, names, trace, fingerprint = verbs_replay(
        "verbs-three", TRIO, 3, RecordingVerbsElsewhere, check=every_page_held_reads_back_exact
    )
    copied = result["cluster_verbs"]["replicated_pages_by_node"]
    assert copied and copied == {names[n]: pages for n, pages in simulator.replicated_pages.items()}
    assert result["cluster_verbs"]["replications"] > 0
    assert all(read_back[node] >= pages > 0 for node, pages in copied.items())
    for counted in ("pages_admitted", "requests_told"):
        assert result["policy_stats"][counted] == simulated["policy_stats"][counted] > 0, counted
    told = [[r for r in records if r[0] == "request"] for records in placed]
    assert sorted(told) == sorted([[r for r in node.policy.seen if r[0] == "request"] for node in simulator.nodes])
    assert_same_pages(placed, simulator, trace, fingerprint)
