"""``kvray sim``: one modeled replay of a trace, printed as the results table or one JSON object.

The node policy and the cluster policy are named as the user passes them: ``lru / cost-router``;
under the oracle every node runs Belady, so the row reads ``belady / oracle``, and a
``--policy`` given beside the oracle is refused rather than silently replaced.

Example::

    result = run_sim(Path("data/traces/synthetic_trace.jsonl"), None, None, None, limit=200)
    print_sim(result, None, warmup_requests=0, console=Console())
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvray.core.errors import ConfigError
from kvray.progress import progress_bar
from kvray.report import ReplayResult
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import ORACLE, simulate
from kvray.traces import read_trace

DEFAULT_NODE_POLICY = "lru"


def run_sim(
    trace: Path,
    policy: str | None,
    cluster_policy: str | None,
    scenario: Path | None,
    warmup_requests: int = 0,
    capacity_fraction: float | None = None,
    capacity: int | None = None,
    limit: int | None = None,
    progress: bool = False,
    load: float | None = None,
) -> ReplayResult:
    """The replay ``kvray sim`` runs; ``policy`` None: the default (Belady under the oracle);
    ``load``: arrival gaps scaled to that busy share under LRU (:mod:`kvray.sim.load`)."""
    if cluster_policy == ORACLE and policy not in (None, "belady"):
        raise ConfigError(f"--cluster-policy {ORACLE} runs Belady on every node: leave out --policy {policy}")
    requests = read_trace(trace, limit=limit)
    spec = load_scenario(scenario or DEFAULT_SCENARIO)
    node_policy = policy or ("belady" if cluster_policy == ORACLE else DEFAULT_NODE_POLICY)
    with progress_bar(len(requests), f"sim {node_policy}", enabled=progress) as tick:
        return simulate(requests, node_policy, spec, warmup_requests, capacity_fraction, capacity, tick, cluster_policy, load)


def print_sim(result: ReplayResult, cluster_policy: str | None, warmup_requests: int, console: Console) -> None:
    """The results table, the tier sizes, the moves between tiers and the busiest links."""
    from kvray.apps.results import print_results
    from kvray.report import format_duration

    label = result.policy if cluster_policy is None else f"{result.policy} / {cluster_policy}"
    print_results({label: result}, console, title=f"kvray sim: modeled replay on scenario {result.scenario}")
    capacity = ", ".join(f"{tier} {pages}" for tier, pages in result.extra["capacity_pages"].items())
    console.print(
        f"capacity (pages): {capacity}; warm-up requests {warmup_requests}; time links spent moving pages between tiers "
        f"{format_duration(result.extra['background_move_ms'] / 1e3)} (summed over the moves, off the TTFT path)"
    )
    busiest = sorted(result.extra["link_utilisation"].items(), key=lambda item: -item[1])[:6]
    console.print("busiest links (busy share over the replay): " + ", ".join(f"{n} {u:.3f}" for n, u in busiest))
