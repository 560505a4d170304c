"""The oracle: the headroom a cluster policy could still win, reported beside the heuristics.

It knows the future: Belady's furthest-next-use eviction on every node, and the best mean
TTFT over a small search, each setting of :class:`~kvray.policy.cluster.PrefetchReplicate`
replayed: requests routed by the front end or by the cost router, every cached prefix
prefetched while its request waits (or not, when the loads would only crowd the links), and
hot-prefix replication after 2 or 8 requests (or none). Belady with today's placement is one
of the settings searched, so the oracle is never worse than it.

Example::
    from kvray.sim.node import node_capacities
    from kvray.scenario import load_scenario
    from kvray.sim.oracle import oracle_replay
    from kvray.sim.workloads import WorkloadSpec, generate

    scenario = load_scenario("h100-4node-skewed")
    trace = generate(WorkloadSpec(sessions=30), seed=3)
    result = oracle_replay(trace, scenario, node_capacities(scenario, trace, 0.05))
    print(result.mean_ttft_ms, result.extra["oracle_setting"], result.extra["oracle_search"])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvray.core.tiers import Tier
from kvray.policy.cluster import PrefetchReplicate
from kvray.report import ReplayResult
from kvray.scenario import Scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.traces import TraceRequest

REPLICATION_THRESHOLDS = (None, 2, 8)  # never, or after that many requests for a prefix


def oracle_settings(nodes: int) -> list[tuple[bool, bool, int | None]]:
    """The (cost routing, prefetch, replication threshold) points searched; one node has
    nothing to route or replicate to."""
    thresholds = REPLICATION_THRESHOLDS if nodes > 1 else (None,)
    routes = (False, True) if nodes > 1 else (False,)
    return [(cost, prefetch, threshold) for cost in routes for prefetch in (False, True) for threshold in thresholds]


def oracle_replay(
    trace: Sequence[TraceRequest],
    scenario: Scenario,
    capacities: Sequence[Mapping[Tier, int]] | None = None,
    warmup_requests: int = 0,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay every setting with Belady on every node; the best mean TTFT's result, with each
    setting's mean TTFT in ``extra["oracle_search"]``."""
    settings = oracle_settings(len(scenario.node_scenarios()))
    best: ReplayResult | None = None
    search: dict[str, float] = {}
    for n, (cost, prefetch, threshold) in enumerate(settings):
        label = f"route={'cost' if cost else 'front'},prefetch={'on' if prefetch else 'off'},replicate={threshold or 'never'}"
        tick = None if progress is None else (lambda i, n=n: progress((n * len(trace) + i) // len(settings)))
        sim = ClusterSimulator(scenario, "belady", PrefetchReplicate(prefetch, threshold, cost), capacities)
        result = sim.replay(trace, warmup_requests, tick)
        search[label] = result.mean_ttft_ms
        if best is None or result.mean_ttft_ms < best.mean_ttft_ms:
            best = result
            best.extra["oracle_setting"] = label
    assert best is not None
    best.policy, best.extra["cluster_policy"], best.extra["oracle_search"] = "oracle", "oracle", search
    return best
