"""What a learned policy sees: one feature row per choice, built only from online state.

A decision is a small set of choices scored by one shared function of a row:

- *admission* (where does a new page go?): one row per option, every present tier and
  "not kept";
- *eviction* (which page leaves a full tier?): one row per candidate, the
  ``CANDIDATES`` least recently used unpinned pages of the tier.

Rows hold heat (hits), recency (age), prefix depth, request shape (its length, the
page's place in it, how much of it was cached: a continuing session), tier occupancy, the
tier's cost relative to recomputing (bandwidth) and the prefill backlog (load): all
visible to the runtime. The trace's future never enters a row; the simulator uses it
only for rewards.

:class:`FeaturePolicy` keeps the state the rows need on top of LRU order; the trained
:class:`~kvray.policy.rl.RLPolicy` and the training environment both build rows through it,
so what the policy is trained on is exactly what it sees when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.tiers import Tier
from kvray.policy.base import PageContext, RequestInfo
from kvray.policy.lru import LRUPolicy

FEATURES = (
    "is_eviction",
    "tier_cost",
    "tier_occupancy",
    "next_tier_cost",
    "log_depth",
    "log_request_pages",
    "log_hits",
    "log_age",
    "rank",
    "log_backlog",
    "log_pages_after",
    "request_hit_fraction",
)
CANDIDATES = 8
DROP_COST = 1.0  # a page not kept costs its recomputation: the unit of tier_cost


class FeaturePolicy(LRUPolicy):
    """LRU bookkeeping plus the feature rows of admission and eviction decisions.

    Its own decisions are LRU's (fastest tier, oldest page); subclasses choose from the rows.

    Example::

        policy = FeaturePolicy()
        manager = CacheManager({Tier.HOST: 8, Tier.DISK: 64}, policy)
        options, rows = policy.admission_rows(PageContext(depth=0, request_pages=4))
        rows.shape        # (3, len(FEATURES)): host, disk, not kept
    """

    name = "features"

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self.options: list[Tier | None] = [*self.tiers, None]
        self.tier_cost: dict[Tier, float] = {t: 0.1 * (1 + int(t)) for t in self.tiers}
        self._backlog = 0.0
        self._hit_fraction: float | None = None
        self._last_depth, self._last_pages = -1, -1
        self._stored_hit_fraction = np.zeros(1024, dtype=np.float32)

    def on_request(self, info: RequestInfo) -> None:
        self._backlog = np.log1p(info.backlog_ms) / 8.0
        self._hit_fraction = None
        if info.tier_cost is not None:
            self.tier_cost = {t: float(info.tier_cost[t]) for t in self.tiers}

    def _cost(self, tier: Tier | None) -> float:
        return DROP_COST if tier is None else self.tier_cost[tier]

    def _occupancy(self, tier: Tier) -> float:
        return len(self._order[tier]) / self.capacities[tier]

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        if handle >= len(self._stored_hit_fraction):
            self._stored_hit_fraction = np.concatenate([self._stored_hit_fraction, np.zeros_like(self._stored_hit_fraction)])
        self._stored_hit_fraction[handle] = self._request_hit_fraction(ctx)

    def _request_hit_fraction(self, ctx: PageContext) -> float:
        """Share of the current request that was cached: the first new page's depth is the
        hit length, since a request's new pages are stored in order after its hits. A new
        request is also recognised without ``on_request`` (a caller that never sends it):
        within one request, stored depths only grow (a page is asked about twice: admission
        and publication)."""
        if self._hit_fraction is None or ctx.depth < self._last_depth or ctx.request_pages != self._last_pages:
            self._hit_fraction = ctx.depth / max(ctx.request_pages, 1)
        self._last_depth, self._last_pages = ctx.depth, ctx.request_pages
        return self._hit_fraction

    def admission_rows(self, ctx: PageContext) -> tuple[list[Tier | None], np.ndarray]:
        rows = np.zeros((len(self.options), len(FEATURES)), dtype=np.float32)
        for i, tier in enumerate(self.options):
            if tier is not None:
                rows[i, 1] = self.tier_cost[tier]
                rows[i, 2] = self._occupancy(tier)
                rows[i, 3] = self._cost(self.demote_target(-1, tier))
            else:
                rows[i, 1] = rows[i, 3] = DROP_COST
        rows[:, 4] = np.log1p(ctx.depth) / 5.0
        rows[:, 5] = np.log1p(ctx.request_pages) / 5.0
        rows[:, 8] = ctx.depth / max(ctx.request_pages, 1)
        rows[:, 9] = self._backlog
        rows[:, 10] = np.log1p(max(ctx.request_pages - 1 - ctx.depth, 0)) / 5.0
        rows[:, 11] = self._request_hit_fraction(ctx)
        return self.options, rows

    def candidates(self, tier: Tier) -> list[int]:
        pins = self.index.pins
        return list(islice((h for h in self._order[tier] if pins[h] == 0), CANDIDATES))

    def eviction_rows(self, tier: Tier, candidates: list[int]) -> np.ndarray:
        index = self.index
        handles = np.asarray(candidates, dtype=np.int64)
        rows = np.empty((len(candidates), len(FEATURES)), dtype=np.float32)
        rows[:, 0] = 1.0
        rows[:, 1] = self.tier_cost[tier]
        rows[:, 2] = self._occupancy(tier)
        rows[:, 3] = self._cost(self.demote_target(-1, tier))
        rows[:, 4] = np.log1p(index.depth[handles]) / 5.0
        rows[:, 5] = 0.0
        rows[:, 6] = np.log1p(index.hits[handles]) / 3.0
        rows[:, 7] = np.log1p(index.clock - index.last_access[handles]) / 15.0
        rows[:, 8] = np.arange(len(candidates)) / CANDIDATES
        rows[:, 9] = self._backlog
        rows[:, 10] = 0.0
        rows[:, 11] = self._stored_hit_fraction[handles]
        return rows


def padded(rows: np.ndarray, size: int = CANDIDATES) -> np.ndarray:
    """``size`` rows: choice ``i`` repeats row ``i mod n``, so any action names a real choice."""
    return rows[np.arange(size) % len(rows)]
