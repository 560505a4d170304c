"""Trace-driven simulator: the runtime's own cache with modeled time in place of bytes.

Each request of a trace is served the way the runtime serves it, through a real
:class:`~kvray.core.manager.CacheManager` (prefix index, slot accounting, placement policy):

1. look up its longest cached prefix (trace ids are page keys) and pin it;
2. model its time to first token: loading each hit page from its tier, prefilling the
   rest, plus the wait for a free prefill engine at the trace's arrival times;
3. unpin, record the hits (heat, recency) and let the policy promote;
4. store its pages that are not cached yet where the policy admits them, evicting and
   demoting by the policy.

The manager's ``mover`` callback adds the modeled cost of a move instead of copying
(docs/design.md, "One policy, two worlds"), so any policy object, trained or not, runs here exactly as it runs
in the runtime. The Belady oracle is told each request's future before it is served.

Example::
    from kvray.policy import make_policy
    from kvray.sim.cost import DEFAULT_SCENARIO, load_scenario
    from kvray.sim.simulator import Simulator
    from kvray.traces import read_trace

    trace = read_trace("conversation_trace_first30min.jsonl", limit=500)   # shipped, or a path
    scenario = load_scenario(DEFAULT_SCENARIO)
    sim = Simulator(scenario, make_policy("lru"), scenario.scaled(fast_pages=2000))
    print(sim.replay(trace).as_json())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvray.core.errors import ConfigError
from kvray.core.manager import CacheManager
from kvray.core.tiers import TIER_LABELS, Tier
from kvray.policy.base import PlacementPolicy, RequestInfo
from kvray.report import ReplayResult, ReplayTally, hit_tokens
from kvray.sim.cost import CostModel, PrefillQueue, Scenario
from kvray.traces import TraceRequest, full_blocks, unique_blocks


def next_uses(trace: Sequence[TraceRequest]) -> list[np.ndarray]:
    """For each request and each of its pages, the index of the next request using that
    page (``inf`` if none): the future that only an offline oracle may see."""
    seen: dict[int, int] = {}
    out: list[np.ndarray] = [np.empty(0)] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        out[i] = np.array([seen.get(h, np.inf) for h in ids], dtype=np.float64)
        for h in ids:
            seen[h] = i
    return out


def session_of(request: TraceRequest) -> str:
    """The flow a request belongs to for fair sharing: its first two prefix ids (the
    shared system prompt and the conversation or document that follows it)."""
    return "/".join(map(str, request.hash_ids[:2]))


def fast_capacity(
    scenario: Scenario, trace: Sequence[TraceRequest], fraction: float | None = None, pages: int | None = None
) -> dict[Tier, int]:
    """Tier sizes for a replay: the scenario's own, or device + host = ``pages`` or
    ``fraction`` of the trace's unique pages, every tier keeping its ratio to them."""
    if fraction is not None and pages is not None:
        raise ConfigError("give --capacity-fraction or --capacity, not both")
    if fraction is not None:
        if not 0 < fraction <= 100:
            raise ConfigError(f"capacity fraction must be in (0, 100], got {fraction}")
        pages = max(1, round(fraction * unique_blocks(list(trace))))
    if pages is None:
        return scenario.capacities()
    if pages <= 0:
        raise ConfigError(f"capacity must be a positive number of pages, got {pages}")
    try:
        return scenario.scaled(pages)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class Simulator:
    """One replay: a fresh CacheManager around ``policy``, a cost model and a prefill queue.

    Example::

        sim = Simulator(scenario, make_policy("belady"))
        result = sim.replay(trace, warmup_requests=500)
        result.token_hit_rate, result.mean_ttft_ms
    """

    def __init__(self, scenario: Scenario, policy: PlacementPolicy, capacities: Mapping[Tier, int] | None = None):
        self.scenario = scenario
        self.cost = CostModel(scenario)
        self.block_tokens = scenario.layout.page_tokens
        self.queue = PrefillQueue(scenario.compute.servers)
        self.manager = CacheManager(capacities or scenario.capacities(), policy, page_nbytes=self.cost.page_nbytes)
        self.policy = policy
        self.background_ms = 0.0  # modeled time of moves between tiers, off the TTFT path
        self._load_ms = np.array([self.cost.load_ms(t) if t in self.manager.slots else 0.0 for t in Tier])
        self.tier_cost = self.cost.tier_cost(self.manager.slots)

    def mover(self, handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        """The data plane of the simulator: a move costs modeled time, no bytes."""
        self.background_ms += self.cost.move_ms(src, dst)

    def serve(self, request: TraceRequest, future: np.ndarray | None = None) -> tuple[list[str], float]:
        """Serve one request; returns the tier label of each hit page and its modeled TTFT (ms)."""
        hit_tiers, ttft_ms = self.begin(request, future)
        self.store(request)
        return hit_tiers, ttft_ms

    def begin(self, request: TraceRequest, future: np.ndarray | None = None) -> tuple[list[str], float]:
        """Everything of serving a request but storing its new pages: lookup, modeled TTFT,
        hit recording and promotion."""
        keys = full_blocks(request.hash_ids, request.input_length, self.block_tokens)
        manager = self.manager
        backlog = self.queue.backlog_ms(request.timestamp_ms)
        self.policy.on_request(RequestInfo(keys, backlog, self.tier_cost, future))
        match = manager.lookup(keys)
        hit_tiers = [TIER_LABELS[t] for t in match.tiers.tolist()]
        manager.pin(match.handles)
        load_ms = float(self._load_ms[match.tiers].sum())
        prefill_ms = self.cost.prefill_ms(request.input_length - hit_tokens(request, len(match), self.block_tokens))
        wait_ms = self.queue.serve(request.timestamp_ms, load_ms + prefill_ms)
        manager.unpin(match.handles)
        manager.touch(match.handles)
        manager.promote(match.handles, self.mover)
        return hit_tiers, wait_ms + load_ms + prefill_ms

    def store(self, request: TraceRequest) -> None:
        """Keep the request's pages not cached yet where the policy admits them, through the
        manager's chain writer (the one :class:`kvray.core.store.PageStore` uses)."""
        keys = full_blocks(request.hash_ids, request.input_length, self.block_tokens)
        self.manager.store_chain(keys, self.mover, tenant=session_of(request))

    def replay(
        self,
        trace: Sequence[TraceRequest],
        warmup_requests: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> ReplayResult:
        """Serve every request in order; the first ``warmup_requests`` fill the cache unmeasured."""
        futures = next_uses(trace) if self.policy.needs_future else None
        tally = ReplayTally(self.block_tokens)
        moved_before = 0
        for i, request in enumerate(trace):
            if i == warmup_requests:
                moved_before = self.manager.metrics.bytes_moved
            hit_tiers, ttft = self.serve(request, None if futures is None else futures[i])
            if i >= warmup_requests:
                tally.record(request, hit_tiers, ttft)
            if progress is not None:
                progress(i)
        return tally.result(
            policy=self.policy.name,
            scenario=self.scenario.name,
            bytes_moved=self.manager.metrics.bytes_moved - moved_before,
            warmup_requests=warmup_requests,
            capacity_pages={t.label: c for t, c in sorted(self.manager.capacities.items())},
            background_move_ms=self.background_ms,
        )


def simulate(
    trace: Sequence[TraceRequest],
    policy: str,
    scenario: Scenario,
    warmup_requests: int = 0,
    capacity_fraction: float | None = None,
    capacity: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """One replay from command-line style options (what ``kvray sim`` and ``kvray eval`` run)."""
    from kvray.policy import make_policy

    if warmup_requests < 0 or warmup_requests >= len(trace):
        raise ConfigError(f"--warmup-requests must be in [0, {len(trace)}) for this trace, got {warmup_requests}")
    capacities = fast_capacity(scenario, trace, capacity_fraction, capacity)
    result = Simulator(scenario, make_policy(policy), capacities).replay(trace, warmup_requests, progress)
    result.policy = policy
    return result
