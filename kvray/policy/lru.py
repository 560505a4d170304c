"""Least-recently-used eviction, the default policy.

A request's hit pages are touched deepest first, so its root pages are the most recent:
within one prefix the tail leaves before the head, as in a radix-tree cache.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvray.core.tiers import Tier
from kvray.policy.base import PlacementPolicy


class LRUPolicy(PlacementPolicy):
    """Evict the least recently used unpinned page of a tier; demote one tier down.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, LRUPolicy())
    """

    name = "lru"

    def bind(self, index, capacities) -> None:
        super().bind(index, capacities)
        self._order: dict[Tier, OrderedDict[int, None]] = {t: OrderedDict() for t in Tier}
        self._tier_of: dict[int, Tier] = {}

    def on_insert(self, handle: int, tier: Tier) -> None:
        self._order[tier][handle] = None
        self._tier_of[handle] = tier

    def on_access(self, handles: np.ndarray) -> None:
        for h in reversed(handles.tolist()):
            self._order[self._tier_of[h]].move_to_end(h)

    def on_remove(self, handle: int, tier: Tier) -> None:
        del self._order[tier][handle]
        del self._tier_of[handle]

    def victim(self, tier: Tier) -> int | None:
        return self._first_unpinned(self._order[tier])
