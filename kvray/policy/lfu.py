"""Least-frequently-used eviction: pages hit most often stay; recency breaks ties."""

from __future__ import annotations

import numpy as np

from kvray.policy.scored import ScoredPolicy


class LFUPolicy(ScoredPolicy):
    """Evict the unpinned page with the fewest hits, the least recent among equals.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, LFUPolicy())
    """

    name = "lfu"
    scores_rise_on_access = True  # a hit adds to the count and to the recency

    def scores(self, handles: np.ndarray | int) -> np.ndarray | float:
        # Exact in float64 while last_access < 2**40: recency only orders equal hit counts.
        return self.index.hits[handles] * float(1 << 40) + self.index.last_access[handles]
