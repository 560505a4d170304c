"""Trace-driven simulator on one node: the runtime's own cache with modeled time in place of bytes.

Each request of a trace is served the way the runtime serves it, through a real
:class:`~kvray.core.manager.CacheManager` (prefix index, slot accounting, placement policy):

1. look up its longest cached prefix (trace ids are page keys);
2. model its time to first token: loading each hit page from its tier over the node's
   links, prefilling the rest, plus the wait for a free prefill engine at the trace's
   arrival times;
3. record the hits (heat, recency) and let the policy promote;
4. store its pages that are not cached yet where the policy admits them, evicting and
   demoting by the policy.

This is the one-node case of the cluster simulator (:mod:`kvray.sim.cluster`): the manager's
``mover`` callback books each move on the node's links instead of copying (docs/design.md,
"One policy, two worlds"), so any policy object, trained or not, runs here exactly as it
runs in the runtime. A scenario without ``nodes`` has unqueued links (moves never delay a
load) unless it says ``links: {queued: true}``. The Belady oracle is told each request's
future before it is served.

Example::
    from kvray.policy import make_policy
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario
    from kvray.sim.simulator import Simulator
    from kvray.traces import read_trace

    trace = read_trace("conversation_trace_first30min.jsonl", limit=500)   # shipped, or a path
    scenario = load_scenario(DEFAULT_SCENARIO)
    sim = Simulator(scenario, make_policy("lru"), scenario.scaled(fast_pages=2000))
    print(sim.replay(trace).as_json())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvray.core.errors import ConfigError, PolicyError
from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import Tier
from kvray.policy.cluster import CLUSTER_POLICIES, make_cluster_policy
from kvray.policy.plugin import is_import_path
from kvray.report import ReplayResult
from kvray.scenario import Scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.traces import TraceRequest


def fast_capacity(
    scenario: Scenario, trace: Sequence[TraceRequest], fraction: float | None = None, pages: int | None = None
) -> dict[Tier, int]:
    """Tier sizes for a replay on one node: the scenario's own, or device + host = ``pages``
    or ``fraction`` of the trace's unique pages, every tier keeping its ratio to them."""
    return node_capacities(scenario, trace, fraction, pages)[0]


class Simulator(ClusterSimulator):
    """One replay on one node: the 1-node case of :class:`~kvray.sim.cluster.ClusterSimulator`
    (a fresh CacheManager around ``policy``, its links and its prefill queue).

    Example::

        sim = Simulator(scenario, make_policy("belady"))
        result = sim.replay(trace, warmup_requests=500)
        result.token_hit_rate, result.mean_ttft_ms
    """

    def __init__(self, scenario: Scenario, policy: PlacementPolicy, capacities: Mapping[Tier, int] | None = None):
        if len(scenario.node_scenarios()) != 1:
            raise ConfigError(f"scenario {scenario.name!r} has several nodes: replay it with ClusterSimulator")
        super().__init__(scenario, [policy], None, [capacities] if capacities else None)
        node = self.nodes[0]
        self.node, self.manager, self.policy, self.cost, self.queue = node, node.manager, policy, node.cost, node.queue
        self.tier_cost = node.tier_cost

    @property
    def background_ms(self) -> float:
        """Modeled time of moves between tiers, off the TTFT path."""
        return self.node.background_ms


ORACLE = "oracle"  # the simulator's own cluster policy (kvray.sim.oracle): Belady on every node, the best settings searched
SIM_CLUSTER_POLICIES = (*CLUSTER_POLICIES, ORACLE)


def simulate(
    trace: Sequence[TraceRequest],
    policy: str,
    scenario: Scenario,
    warmup_requests: int = 0,
    capacity_fraction: float | None = None,
    capacity: int | None = None,
    progress: Callable[[int], None] | None = None,
    cluster_policy: str | None = None,
    load: float | None = None,
) -> ReplayResult:
    """One replay from command-line style options (what ``kvray sim`` and ``kvray eval`` run):
    ``policy`` on every node, ``cluster_policy`` (a name of
    :data:`~kvray.policy.cluster.CLUSTER_POLICIES`, or ``oracle``: Belady on every node, in
    place of ``policy``, under the best routing, prefetch and replication found) above them
    on a scenario of several nodes; none gives the runtime's default, ``local-first``. With
    ``load`` the trace's arrival gaps are scaled so that LRU keeps the prefill engines busy
    that share of the time (:mod:`kvray.sim.load`; the factor is the result's ``load``)."""
    if warmup_requests < 0 or warmup_requests >= len(trace):
        raise ConfigError(f"--warmup-requests must be in [0, {len(trace)}) for this trace, got {warmup_requests}")
    if cluster_policy is not None:
        _check_cluster_policy(cluster_policy, scenario)
    capacities = node_capacities(scenario, trace, capacity_fraction, capacity)
    scaling = None
    if load is not None:
        from kvray.sim.load import find_load

        scaling = find_load(trace, scenario, load, capacities, warmup_requests)
        trace = scaling.trace
    if cluster_policy == ORACLE:
        from kvray.sim.oracle import oracle_replay

        result = oracle_replay(trace, scenario, capacities, warmup_requests, progress)
        result.policy = "belady"  # what every node ran; the cluster policy stays "oracle"
    else:
        cluster = make_cluster_policy(cluster_policy) if cluster_policy else None
        result = ClusterSimulator(scenario, policy, cluster, capacities).replay(trace, warmup_requests, progress)
        result.policy = policy
    if scaling is not None:
        result.extra["load"] = scaling.as_dict()
    return result


def _check_cluster_policy(name: str, scenario: Scenario) -> None:
    """A cluster policy decides across nodes: one named for a one-node scenario, or a name
    the simulator does not know, is refused naming the flag."""
    if len(scenario.node_scenarios()) == 1:
        raise ConfigError(
            f"--cluster-policy {name}: scenario {scenario.name!r} has one node, and a cluster policy decides "
            "across nodes; give a scenario of several (--scenario, e.g. simulations/h100-4node-skewed.yaml)"
        )
    if name not in SIM_CLUSTER_POLICIES and not is_import_path(name) and name.partition(":")[0] != "rl-router":
        raise PolicyError(f"unknown cluster policy {name!r}; known: {', '.join(sorted(SIM_CLUSTER_POLICIES))}")
