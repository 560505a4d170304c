"""The controller's placement seam without Ray: the cluster policy decides, from what the
stores and engines reported (kvray.cluster.observe).

The Controller class runs in this process (as benchmarks weigh it); its store handles are
stand-ins because placement never calls a store.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.cluster.config import RuntimeConfig
from kvray.cluster.controller import Controller
from kvray.cluster.observe import ClusterObservations, LinkSpeeds, NodeReport
from kvray.cluster.protocol import Decision
from kvray.core.errors import PolicyError
from kvray.core.hashring import HashRing
from kvray.core.tiers import Tier
from kvray.policy.cluster import ClusterPolicy, RequestView
from kvray.policy.residual import WRITE_BUDGET_CHOICES, ResidualRouter
from tests.properties import examples

NIC = LinkSpeeds().nic_gbps * 1e9  # bytes/s


def report(free_host: int = 10, nic_out: int = 0, disk_write: int = 0) -> NodeReport:
    return NodeReport((0, free_host, 0), (0, 40, 0), (0, nic_out, 0, 0, disk_write))


def test_utilisation_is_the_share_of_a_link_used_over_the_window():
    seen = ClusterObservations(LinkSpeeds(), window_s=1.0)
    seen.report("a", report(), now=0.0)
    seen.report("a", report(nic_out=int(NIC / 2)), now=0.5)
    assert seen.utilisation("a", now=1.0)[1] == pytest.approx(0.5)  # half a second's worth over the second since t=0
    assert seen.utilisation("a", now=2.0) == (0.0,) * 5  # nothing reported since the window began
    seen.report("a", report(nic_out=int(NIC / 2) + int(NIC * 3)), now=2.2)
    assert seen.utilisation("a", now=2.4)[1] == 1.0  # more than the link carries: saturated, never above 1
    assert seen.utilisation("b", now=2.4) == (0.0,) * 5  # never heard from


def test_views_carry_free_shares_backlogs_and_forget_nodes_that_left():
    seen = ClusterObservations(LinkSpeeds(), window_s=1.0, empty={"host": 1.0})
    seen.report("a", report(free_host=10, disk_write=10**9), now=0.0)
    seen.report("a", report(free_host=10, disk_write=2 * 10**9), now=0.5)
    seen.backlog("a", 3.0)
    view = seen.view(["a", "b"], now=1.0)
    assert view.names == ["a", "b"]
    assert view.node("a").free_share == {"host": 0.25} and view.node("a").backlog_ms == 3.0
    assert view.node("a").disk_write_util == pytest.approx(0.5)  # 1 GB over a second of a 2 GB/s disk
    assert view.node("b").free_share == {"host": 1.0} and view.node("b").backlog_ms == 0.0
    seen.forget("a")
    assert seen.view(["a"], now=1.0).node("a").free_share == {"host": 1.0}


def controller(nodes: list[str], **config) -> Controller:
    ctrl = Controller(RuntimeConfig(**config))
    for node in nodes:
        ctrl.register_store(node, store=object())
    return ctrl


@settings(max_examples=examples(60), deadline=None)
@given(
    nodes=st.lists(st.sampled_from(["n0", "n1", "n2", "n3"]), min_size=1, max_size=4, unique=True),
    keys=st.lists(st.integers(0, 2**128 - 1), min_size=1, max_size=40, unique=True),
    cached=st.integers(0, 40),
    limit=st.integers(0, 30),
    requester=st.sampled_from(["n0", "n1", "outside"]),
)
def test_local_first_places_as_the_rule_it_replaced(nodes, keys, cached, limit, requester):
    """The default policy answers exactly what the controller's inline rule did: the
    requester's node for a request of at most local_limit pages, else the hash ring of the
    live nodes over the missing pages."""
    ctrl = controller(nodes, local_pages_limit=limit)
    cached = min(cached, len(keys))
    if cached:
        ctrl.commit(None, keys[:cached], [nodes[0]] * cached, 0, {})
    plan = ctrl.lookup_pin(keys, requester)
    assert plan.hit_nodes == [nodes[0]] * cached
    missing = keys[cached:]
    if not missing:
        assert plan.targets == []
    elif requester in nodes and len(keys) <= limit:
        assert plan.targets == [requester] * len(missing)
    else:
        assert plan.targets == HashRing(nodes).owners(missing)


def test_the_policy_sees_what_stores_and_engines_reported():
    ctrl = controller(["a", "b"], tiers={"host": 40})
    ctrl.commit(None, [1, 2], ["b", "b"], 0, {}, {"b": report(free_host=30)})
    ctrl.lookup_pin([1, 2, 3], "a", backlog_ms=7.5)
    view = ctrl.cluster_view()
    assert view.node("a").free_share == {"host": 1.0} and view.node("a").backlog_ms == 7.5
    assert view.node("b").free_share == {"host": 0.75} and view.node("b").backlog_ms == 0.0
    ctrl.remove_node("b")
    assert ctrl.cluster_view().names == ["a"]


def test_locate_tells_a_router_where_a_prefix_lives_without_pinning_or_counting_it():
    ctrl = controller(["a", "b"], tiers={"host": 40})
    ctrl.commit(None, [1, 2, 3], ["b", "b", "a"], 0, {})
    ctrl.lookup_pin([9], "a", backlog_ms=4.0)
    before = ctrl.snapshot()
    request, view = ctrl.locate([1, 2, 3, 4])
    assert request == RequestView((1, 2, 3, 4), None, ("b", "b", "a"), hit_tiers=("host",) * 3)  # as decide shows it
    assert view.names == ["a", "b"] and view.node("a").backlog_ms == 4.0
    after = ctrl.snapshot()
    assert (after["lookups"], after["lookup_pages"], after["open_leases"]) == (
        before["lookups"], before["lookup_pages"], before["open_leases"],
    )  # fmt: skip
    assert int(ctrl.index.pins[ctrl.index.handle_of(1)]) == 0


class Elsewhere(ClusterPolicy):
    name = "elsewhere"

    def place(self, request, missing, cluster):
        return ["nowhere"] * missing


def test_a_policy_naming_no_live_node_is_refused_by_name():
    ctrl = controller(["a"])
    ctrl.policy = Elsewhere()
    with pytest.raises(PolicyError, match="elsewhere.*nowhere.*one live node"):
        ctrl.lookup_pin([1, 2], "a")


def test_unknown_cluster_policies_and_tier_costs_are_refused_where_they_enter():
    with pytest.raises(ValueError, match="unknown cluster policy 'nope'; known: .*local-first"):
        RuntimeConfig(cluster_policy="nope")
    with pytest.raises(ValueError, match="is not a ClusterPolicy subclass"):
        RuntimeConfig(cluster_policy="kvray.core.placement:LRUPolicy")
    with pytest.raises(ValueError, match="tier_cost: unknown tier"):
        RuntimeConfig(tier_cost={"tape": 1.0})
    assert RuntimeConfig(tier_cost={"host": 0.3}).tier_costs() == {Tier.HOST: 0.3}


class EveryVerb(ClusterPolicy):
    """Routes to b, loads one page, prefetches, replicates to the serving node; writes down what each verb saw."""

    name = "every-verb"

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def route(self, request, cluster):
        self.seen.append(("route", request, cluster))
        return "b"

    def load_pages(self, request, cluster):
        self.seen.append(("load_pages", request, cluster))
        return 1

    def prefetch(self, request, cluster):
        return True

    def replicate(self, request, cluster):
        return [request.requester, "gone"]


def test_decide_asks_every_verb_what_the_simulator_asks_it():
    ctrl = controller(["a", "b", "c"], tiers={"host": 40}, page_prefill_ms=2.5)
    ctrl.policy = EveryVerb()
    ctrl.commit(None, [1, 2, 3], ["a", "a", "a"], 0, {})
    decision = ctrl.decide([1, 2, 3, 4], "c", backlog_ms=3.0)
    assert decision == Decision("b", hit_pages=3, load_pages=1, prefetch=True, replicate=("b",))  # "gone" is no live node
    (_, routed, cluster), (_, served, _) = ctrl.policy.seen
    assert routed == RequestView((1, 2, 3, 4), "c", ("a", "a", "a"), hit_tiers=("host",) * 3)  # one tier: every page's
    assert served.requester == "b" and served.hit_nodes == routed.hit_nodes
    assert cluster.page_prefill_ms == 2.5 and cluster.node("c").backlog_ms == 3.0
    assert ctrl.snapshot()["lookups"] == 0 and int(ctrl.index.pins[ctrl.index.handle_of(1)]) == 0  # nothing pinned or counted
    ctrl.policy.seen.clear()
    kept = ctrl.decide([1, 2, 3, 4], "c", route=False)  # an engine already routed to asks the other verbs
    assert kept.node == "c" and [verb for verb, *_ in ctrl.policy.seen] == ["route", "load_pages"]  # route: b, ignored
    assert ctrl.policy.seen[1][1].requester == "c"
    ctrl.policy = Elsewhere()
    ctrl.policy.route = lambda request, cluster: "nowhere"
    with pytest.raises(PolicyError, match="routed to 'nowhere'"):
        ctrl.decide([1], "a")


def test_a_learned_policy_decides_the_verbs_of_an_engine_already_routed_to(tmp_path):
    """rl-router decides every verb of a request in ``route``: an engine that asks with
    route=False (the Ray Serve router routed it) must get them, not the defaults; its write
    budget, a share of the node's drive rate (the runtime's link speeds), reaches the store."""
    ctrl = controller(["a", "b"], tiers={"host": 256, "disk": 64}, disk_root=tmp_path)
    store = BudgetRecorder()
    ctrl.register_store("b", store=store)
    # the other node, load half, prefetch, replicate, a write budget of a fifth of the drive's rate
    choice = [1, 2, 1, 1, 3]
    ctrl.policy = ResidualRouter(decide=lambda obs: choice)
    ctrl.commit(None, [1, 2, 3, 4], ["a"] * 4, 0, {})
    assert ctrl.decide([1, 2, 3, 4, 5], "b", route=False) == Decision("b", 4, 2, True, ("b",))
    assert store.sent == [WRITE_BUDGET_CHOICES[3] * LinkSpeeds().disk_write_gbps * 1e9]
    choice[0], choice[4] = 0, 4  # the router would pick a (it holds the prefix), but b's engine serves: b's budget
    assert ctrl.decide([1, 2, 3, 4, 5], "b", route=False).node == "b"
    assert store.sent[-1] == WRITE_BUDGET_CHOICES[4] * LinkSpeeds().disk_write_gbps * 1e9
    assert ctrl.policy.write_budgets == {"b": WRITE_BUDGET_CHOICES[4]}  # none went to the router's pick


def test_a_replica_is_read_where_it_is_and_outlives_its_original():
    ctrl = controller(["a", "b", "c"])
    ctrl.commit(None, [1, 2], ["a", "a"], 0, {})
    ctrl.commit(None, [1, 2, 3], ["b", "b", "b"], 0, {}, replica=True)  # 3 was indexed nowhere: b is its location
    assert ctrl.lookup_pin([1, 2, 3], "b").hit_nodes == ["b", "b", "b"]
    assert ctrl.lookup_pin([1, 2, 3], "c").hit_nodes == ["a", "a", "b"]  # the first location, then the page before's
    ctrl.commit(None, [], [], 0, {"a": [1, 2]})  # a evicted its copies: b's remain
    assert ctrl.lookup_pin([1, 2, 3], "c").hit_nodes == ["b", "b", "b"]
    assert ctrl.replicas == {}
    ctrl.commit(None, [], [], 0, {"b": [2]})  # the last copy of 2: it goes, and 3 under it
    assert ctrl.lookup_pin([1, 2, 3], "c").hit_nodes == ["b"]
    ctrl.commit(None, [2], ["c"], 1, {}, replica=True)
    ctrl.remove_node("b")  # 1 had no other copy; 2 hangs under it
    assert ctrl.lookup_pin([1, 2], "c").hit_nodes == []


class BudgetRecorder:
    """A store handle that records the NVMe write budgets the controller sends it."""

    def __init__(self) -> None:
        self.sent: list[float | None] = []
        self.set_disk_write_budget = SimpleNamespace(remote=self.sent.append)


class Budgeted(ClusterPolicy):
    name = "budgeted"
    rate: float | None = 5e6

    def disk_write_budget(self, node, cluster):
        return self.rate


def test_the_policys_disk_write_budget_reaches_the_serving_store_when_it_changes():
    ctrl = Controller(RuntimeConfig())
    stores = {node: BudgetRecorder() for node in ("a", "b")}
    for node, store in stores.items():
        ctrl.register_store(node, store=store)
    ctrl.decide([1, 2], "a")
    assert stores["a"].sent == []  # the default policy sets no budget: nothing is sent
    ctrl.policy = Budgeted()
    ctrl.decide([1, 2], "a")
    ctrl.decide([3], "a")
    assert stores["a"].sent == [5e6] and stores["b"].sent == []  # once, to the serving node
    ctrl.policy.rate = None
    ctrl.decide([1], "a")
    assert stores["a"].sent == [5e6, None]
    ctrl.register_store("a", store=stores["a"])  # a restarted store starts without one
    ctrl.policy.rate = 5e6
    ctrl.decide([1], "a")
    assert stores["a"].sent == [5e6, None, 5e6]
    ctrl.policy.rate = float("nan")
    with pytest.raises(PolicyError, match="'budgeted'.*disk write budget"):
        ctrl.decide([1], "a")


def test_kvray_run_sees_a_scenarios_drive_at_the_rate_the_simulator_does():
    """settings_of_sim_scenario gives the runtime the scenario's drive rates, so a write
    budget (a share of NodeView.disk_write_gbps) caps the same bytes in both worlds."""
    from kvray.apps.replay import settings_of_sim_scenario
    from kvray.policy.cluster import CostRouter
    from kvray.scenario import load_scenario
    from kvray.sim.cluster import ClusterSimulator

    scenario = load_scenario("h100-llama8b")
    links = LinkSpeeds(**settings_of_sim_scenario(scenario)["runtime"]["links"])
    seen = ClusterObservations(links, window_s=1.0, empty={"host": 1.0, "disk": 1.0}).view(["a"], now=0.0).node("a")
    simulated = ClusterSimulator(scenario, "lru", CostRouter(), [{Tier.HOST: 8, Tier.DISK: 8}]).cluster_view(0.0).nodes[0]
    assert seen.disk_write_gbps == simulated.disk_write_gbps == scenario.tiers["disk"].write_gbps != LinkSpeeds().disk_write_gbps
