"""Adapting to the workload online: follow whichever heuristic expert is doing best.

No fixed eviction rule is best everywhere: LRU, ARC and the threshold rule (and LFU) each win
on some workload and capacity and lose badly on another (docs/sim-eval). This policy keeps
every expert's bookkeeping over the real cache (so any of them can name the next victim
or admission tier at any time) and, beside it, a *shadow cache* per expert: a metadata-only
:class:`~kvray.core.manager.CacheManager` of the same tier sizes replaying the same
request stream under that expert alone, so each expert's cost on this very workload is
known without ever acting on it. Every ``WINDOW`` requests a *selector* reads the
experts' recent and long-run shadow costs (plus the real cache's own cost, the prefill
backlog and ARC's ghost hits: all online state) and picks the expert whose decisions the
real cache follows for the next window.

Costs are modeled time to first token where the request says what time costs (the
simulator: ``RequestInfo.page_prefill_ms``): each shadow has its own prefill queue, so an
expert that misses during a burst pays for the queue it would have built. Mean TTFT near
saturation is far from linear in pages: on one agent workload at 25% capacity ARC's TTFT is
146x LRU's for a few percent more misses, which page costs could not see. Elsewhere costs
are in page prefills: a hit page costs its tier's load time relative to recomputing it
(``RequestInfo.tier_cost``), a missed page costs 1.

The selector is a function of the rows of :meth:`ExpertsPolicy.selector_rows` (one row
per expert, :data:`SELECTOR_FEATURES`): :func:`follow_the_leader` (the expert with the
lowest smoothed cost) here; in :class:`kvray.policy.rl.RLPolicy` the same ranking
(:func:`leader_scores`) plus a trained, bounded correction (:func:`corrected_scores`), learned in the training environment
(:mod:`kvray.rl.env`). A selector trained from scratch collapsed onto one expert (the
threshold rule, 14.5x the best heuristic on one held-out cell); starting from the leader
it can only learn deviations that paid in training.

Example::
    from kvray.core.manager import CacheManager
    from kvray.core.tiers import Tier
    from kvray.core.placement import RequestInfo
    from kvray.policy.experts import ExpertsPolicy

    policy = ExpertsPolicy()                           # follow the leader
    manager = CacheManager({Tier.HOST: 8, Tier.DISK: 32}, policy)
    policy.on_request(RequestInfo(keys=(1, 2, 3)))     # shadows serve it too
    policy.selector_rows().shape                       # (3, len(SELECTOR_FEATURES))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvray.core.index import ROOT, PrefixIndex
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy, PageContext, PlacementPolicy, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.arc import ARCPolicy
from kvray.policy.threshold import ThresholdPolicy
from kvray.scenario import PrefillQueue

# The experts, each built fresh per shadow and per real cache; lfu's shadow replays 5x slower
# than these (docs/sim-eval). A learned selector's features name them (SELECTOR_FEATURES).
EXPERT_POLICIES: dict[str, Callable[[], PlacementPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy, "threshold": ThresholdPolicy}
EXPERTS = tuple(EXPERT_POLICIES)
WINDOW = 32  # requests between two choices of expert
LONG_HALF_LIFE = 16.0  # windows: the smoothed cost forgets half of its past in this many (4: 1.117x the best heuristic, geomean over the 20 training cells; 16: 1.074x)
SELECTOR_FEATURES = (
    "window_cost_gap",
    "smoothed_cost_gap",
    "previous_window_cost_gap",
    "total_cost_gap",
    "is_current",
    *(f"expert_{name}" for name in EXPERTS),
    "real_cost_gap",
    "log_backlog",
    "ghost_hit_rate",
    "best_hit_rate",
)

_DECAY = 0.5 ** (1.0 / (LONG_HALF_LIFE * WINDOW))  # per request
Selector = Callable[[np.ndarray], int]  # rows -> index of the expert to follow


def _gap(costs: np.ndarray) -> np.ndarray:
    """Each cost's excess over the lowest, relative to it, capped at 4."""
    return np.minimum((costs - costs.min()) / max(float(costs.min()), 1e-3), 4.0)


LEADER_PRIOR = 8.0  # score per unit of smoothed cost gap: a learned selector's starting point


def leader_scores(rows: np.ndarray) -> np.ndarray:
    """Scores ranking experts by their smoothed cost, lowest first: the prior a learned
    selector adds its own scores to, so that an untrained (zero) correction follows the
    leader and training only learns where to deviate. Works on ``[..., experts, features]``."""
    return -LEADER_PRIOR * rows[..., SELECTOR_FEATURES.index("smoothed_cost_gap")]


CORRECTION_BOUND = 2.0  # the most a learned correction moves an expert's score (corrected_scores)


def corrected_scores(rows: np.ndarray, correction):
    """The leader ranking plus a learned selector's ``correction``, bounded to
    +-:data:`CORRECTION_BOUND`: it moves an expert's score by at most a quarter of a unit of
    smoothed cost gap, so it may prefer an expert whose smoothed cost is up to 50% above
    another's, never one the shadows rank far behind. A fitted MLP
    extrapolates linearly from rows unlike its training data: at half the trained link
    bandwidth, with prefill backlogs it never saw, the unbounded correction followed ARC
    while ARC's shadow cost 5x LRU's and the cell's mean TTFT was 20x the best heuristic's.
    The bound was chosen on the training cells (bounds 1.5-3: geometric mean 1.027-1.030x the
    best heuristic, worst 1.49x; unbounded 1.160x, worst 7.54x; docs/sim-eval). The fit
    itself is unbounded (:mod:`kvray.rl.counterfactual`). Works on numpy arrays and torch
    tensors, ``[..., experts, features]`` rows and ``[..., experts]`` corrections."""
    return leader_scores(rows) + correction.clip(-CORRECTION_BOUND, CORRECTION_BOUND)


def follow_the_leader(rows: np.ndarray) -> int:
    """The expert with the lowest smoothed cost (the first among equals)."""
    return int(np.argmax(leader_scores(rows)))


def _no_move(handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
    """Shadows hold metadata only: a move moves nothing."""


# The simulator's chain writer in C (kvray/sim/_chain.c), handed in by kvray.sim.node when it is
# loaded (the policy layer builds below the simulator's): a shadow stores through it as a replay
# does (LRU's hooks transcribed, any other policy's called), over links that take no time, so
# its moves and writes book nothing. Where the simulator is not loaded (a runtime store's
# tripwire) shadows store with the manager's Python, to the same decisions.
_compiled_chain = None


def use_compiled_chain(writer) -> None:
    """Shadows store chains through ``writer`` (``kvray.sim._chain``; None: the manager's Python)."""
    global _compiled_chain
    _compiled_chain = writer


class ShadowCache:
    """One expert replaying the request stream alone over tiers of the real cache's sizes.

    Example::

        shadow = ShadowCache(LRUPolicy(), {Tier.HOST: 8})
        shadow.serve((1, 2, 3), {Tier.HOST: 0.1})   # 3.0: three misses
        shadow.serve((1, 2, 3), {Tier.HOST: 0.1})   # 0.3: three host hits
    """

    def __init__(self, expert: PlacementPolicy, capacities: Mapping[Tier, int]) -> None:
        self.manager = CacheManager(capacities, expert, page_nbytes=1)
        self._lru = type(expert) is LRUPolicy
        self._links = _NoLinks(self.manager.tiers)

    def serve(self, keys: Sequence[int], tier_cost: Mapping[Tier, float], info: RequestInfo | None = None) -> tuple[float, int]:
        """The request's cost in page prefills and its hit pages; then its pages are stored.
        With ``info`` the expert is told of the request first (one that keeps per-request
        state, such as the learned policy's features)."""
        manager = self.manager
        if info is not None:
            manager.policy.on_request(info)
        match = manager.lookup(keys, count=False)
        cost = float(len(keys) - len(match))
        for tier in match.tiers.tolist():
            cost += tier_cost[Tier(tier)]
        manager.touch(match.handles)
        manager.promote(match.handles, _no_move)
        compiled = _compiled_chain
        if compiled is not None and manager.chain_compilable:
            compiled.store_chain(manager, self._links, keys, None, ROOT, 0, len(keys), "", not self._lru, *native(manager.policy))
        else:
            manager.store_chain(keys, _no_move)
        return cost, len(match)

    def disk_writes(self) -> int:
        """Pages written to the disk tier so far: stored there, or demoted to it."""
        return self.manager.metrics.written_pages(Tier.DISK.label)


def native(policy: PlacementPolicy) -> tuple[bool, ...]:
    """The compiled chain writer's last argument: ``(True,)`` where it keeps the policy's own
    bookkeeping in C (``native_hooks``), else none (its hooks called as the manager calls them)."""
    return (True,) if policy.native_hooks else ()


class _NoLinks:
    """What the compiled chain writer reads of a simulated node (kvray/sim/_chain.c): the paths
    of its moves and writes, here without links, so a shadow's replay books nothing."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._moves = {(src, dst): ((), 0.0, "move") for src in tiers for dst in tiers if src != dst}
        self._stores = {tier: ((), 0.0) for tier in tiers}
        self.clock = 0.0
        self.page_nbytes = 1
        self.background_ms = 0.0


class ExpertsPolicy(PlacementPolicy):
    """Follows, window by window, the expert its ``selector`` picks from the shadow costs.

    Example::

        policy = ExpertsPolicy(selector=lambda rows: 2)     # always ARC
        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, policy)
    """

    name = "experts"

    def __init__(
        self,
        selector: Selector | None = follow_the_leader,
        experts: Mapping[str, Callable[[], PlacementPolicy]] = EXPERT_POLICIES,
    ) -> None:
        """``experts``: each expert's name and what builds it (one for the real cache's
        bookkeeping, one for its shadow)."""
        self.selector = selector
        self.experts = dict(experts)
        self.expert_names = tuple(self.experts)

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self.advisors = [build() for build in self.experts.values()]
        for advisor in self.advisors:
            advisor.bind(index, capacities)
        self.shadows = [ShadowCache(build(), capacities) for build in self.experts.values()]
        self._prefill_queues: list[PrefillQueue] = []  # one per shadow, once a request tells the engines
        self.tier_cost: dict[Tier, float] = {t: 0.1 * (1 + int(t)) for t in self.tiers}
        self.current = 0
        self.requests = 0
        self.log_backlog = 0.0
        n = len(self.expert_names)
        self._window_cost = np.zeros(n)
        self._window_hits = np.zeros(n)
        self._previous_gap = np.zeros(n)
        self._smoothed = np.zeros(n)
        self._total = np.zeros(n)
        self._real_cost = 0.0  # in pages, like _window_page_cost (the real queue is not modeled)
        self._window_page_cost = np.zeros(n)
        self._window_pages = 0
        self._stored = 0
        arc = self.expert_names.index("arc") if "arc" in self.expert_names else None
        self._arc = None if arc is None else self.advisors[arc]
        self._ghosts_before = 0

    # -- the selector ----------------------------------------------------------------
    def selector_rows(self) -> np.ndarray:
        """One row per expert (:data:`SELECTOR_FEATURES`) from the window just ended."""
        n = len(self.expert_names)
        rows = np.zeros((n, len(SELECTOR_FEATURES)), dtype=np.float32)
        costs = self._window_cost + 1e-9
        rows[:, 0] = _gap(costs)
        rows[:, 1] = _gap(self._smoothed + 1e-9)
        rows[:, 2] = self._previous_gap
        rows[:, 3] = _gap(self._total + 1e-9)
        rows[self.current, 4] = 1.0
        for i, name in enumerate(self.expert_names):
            if name in EXPERTS:
                rows[i, 5 + EXPERTS.index(name)] = 1.0
        base = 5 + len(EXPERTS)
        page_costs = self._window_page_cost + 1e-9
        rows[:, base] = min((self._real_cost - page_costs.min()) / max(float(page_costs.min()), 1e-3), 4.0)
        rows[:, base + 1] = self.log_backlog
        ghosts = 0 if self._arc is None else self._arc.ghost_hits - self._ghosts_before
        rows[:, base + 2] = ghosts / max(self._stored, 1)
        rows[:, base + 3] = self._window_hits.max() / max(self._window_pages, 1)
        return rows

    def window_costs(self) -> np.ndarray:
        """Each expert's shadow cost in the current window so far (what a selector's rows
        summarise; the counterfactual labels of :mod:`kvray.rl.counterfactual`)."""
        return self._window_cost.copy()

    def _choose(self) -> None:
        rows = self.selector_rows()
        self._previous_gap = rows[:, 0].copy()
        if self.selector is not None:
            self.current = int(self.selector(rows)) % len(self.expert_names)
        self._window_cost[:] = 0.0
        self._window_hits[:] = 0.0
        self._real_cost = 0.0
        self._window_page_cost[:] = 0.0
        self._window_pages = self._stored = 0
        self._ghosts_before = 0 if self._arc is None else self._arc.ghost_hits

    def on_request(self, info: RequestInfo) -> None:
        if self.requests % WINDOW == 0:
            self._choose()
        self.requests += 1
        if info.tier_cost is not None:
            self.tier_cost = {t: float(info.tier_cost[t]) for t in self.tiers}
        self.log_backlog = float(np.log1p(info.backlog_ms)) / 8.0
        request_cost = np.empty(len(self.shadows))
        for i, shadow in enumerate(self.shadows):
            request_cost[i], hits = shadow.serve(info.keys, self.tier_cost)
            self._window_hits[i] += hits
        self._window_page_cost += request_cost
        if info.page_prefill_ms > 0:
            if not self._prefill_queues:
                self._prefill_queues = [PrefillQueue(info.engines) for _ in self.shadows]
            for i, queue in enumerate(self._prefill_queues):
                service_ms = request_cost[i] * info.page_prefill_ms
                request_cost[i] = queue.serve(info.arrival_ms, service_ms) + service_ms
        self._window_cost += request_cost
        self._smoothed = self._smoothed * _DECAY + request_cost
        self._total += request_cost
        self._real_cost += len(info.keys)  # hits are credited back in on_access
        self._window_pages += len(info.keys)
        for advisor in self.advisors:
            advisor.on_request(info)

    # -- the real cache follows the current expert -----------------------------------
    def admit(self, ctx: PageContext) -> Tier | None:
        return self.advisors[self.current].admit(ctx)

    def victim(self, tier: Tier) -> int | None:
        return self.advisors[self.current].victim(tier)

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        return self.advisors[self.current].demote_target(handle, tier)

    def promote_target(self, handle: int, tier: Tier) -> Tier | None:
        return self.advisors[self.current].promote_target(handle, tier)

    # -- every expert keeps its bookkeeping over the real cache ----------------------
    def on_insert(self, handle: int, tier: Tier) -> None:
        for advisor in self.advisors:
            advisor.on_insert(handle, tier)

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        self._stored += 1
        for advisor in self.advisors:
            advisor.on_admitted(handle, ctx)

    def on_access(self, handles: np.ndarray) -> None:
        for tier in self.index.tier[handles].tolist():
            self._real_cost -= 1.0 - self.tier_cost[Tier(tier)]
        for advisor in self.advisors:
            advisor.on_access(handles)

    def on_remove(self, handle: int, tier: Tier) -> None:
        for advisor in self.advisors:
            advisor.on_remove(handle, tier)
