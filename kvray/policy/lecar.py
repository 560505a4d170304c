"""LeCaR (Vietri et al., HotStorage'18): recency and frequency as two experts whose
weights follow their regrets, one instance per tier.

Each tier evicts either its least recently used page or its least frequently used one
(fewest hits, the least recent among equals), drawing the expert by its weight. The keys
each expert evicted are remembered (one history per expert, as large as the tier); when an
evicted key comes back into the tier, the expert that sent it away was wrong and its
weight shrinks by ``exp(-learning_rate * discount ** age)``, the more the sooner it came
back. Workloads that reward recency and those that reward frequency each get the mix that
suits them, as ARC's adaptive split does, but with any two orderings. Draws come from a
seeded generator: a replay is deterministic.

Example::
    from kvray.core.manager import CacheManager
    from kvray.core.tiers import Tier
    from kvray.policy.lecar import LeCaRPolicy

    manager = CacheManager({Tier.HOST: 2, Tier.DISK: 8}, LeCaRPolicy(seed=0))
    manager.store_chain([1, 2, 3], mover=lambda *move: None)    # the third page demotes one
    assert len(manager.lookup([1, 2, 3])) == 3
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import Tier

LRU, LFU = 0, 1


class _Experts:
    """One tier's state: recency order, frequency buckets, weights and histories."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.recency: OrderedDict[int, None] = OrderedDict()
        self.buckets: dict[int, OrderedDict[int, None]] = {}  # hits -> handles, least recent first
        self.weights = [0.5, 0.5]
        self.history: tuple[OrderedDict[int, int], OrderedDict[int, int]] = (OrderedDict(), OrderedDict())
        self.discount = 0.005 ** (1.0 / self.capacity)


class LeCaRPolicy(PlacementPolicy):
    """LeCaR eviction in every tier; demote one tier down.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, LeCaRPolicy(seed=1))
    """

    name = "lecar"

    def __init__(self, learning_rate: float = 0.45, seed: int = 0) -> None:
        self.learning_rate = learning_rate
        self.seed = seed

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._experts = {t: _Experts(capacities[t]) for t in self.tiers}
        self._chosen: dict[int, int] = {}  # handle -> the expert that named it victim last
        self._rng = random.Random(self.seed)
        self._clock = 0

    def on_insert(self, handle: int, tier: Tier) -> None:
        experts, key = self._experts[tier], self.index.key_of(handle)
        self._clock += 1
        for expert in (LRU, LFU):
            evicted_at = experts.history[expert].pop(key, None)
            if evicted_at is not None:  # that expert sent it away too early
                regret = experts.discount ** (self._clock - evicted_at)
                experts.weights[expert] *= math.exp(-self.learning_rate * regret)
                total = sum(experts.weights)
                experts.weights = [w / total for w in experts.weights]
        experts.recency[handle] = None
        experts.buckets.setdefault(int(self.index.hits[handle]), OrderedDict())[handle] = None

    def on_access(self, handles: np.ndarray) -> None:
        self._clock += 1
        tiers = self.index.tier[handles].tolist()
        hits = self.index.hits[handles].tolist()  # counted already: each was one less when bucketed
        for h, tier, freq in zip(reversed(handles.tolist()), reversed(tiers), reversed(hits)):  # the root ends most recent
            experts = self._experts[Tier(tier)]
            experts.recency.move_to_end(h)
            self._unbucket(experts, h, freq - 1)
            experts.buckets.setdefault(freq, OrderedDict())[h] = None

    def on_remove(self, handle: int, tier: Tier) -> None:
        experts = self._experts[tier]
        del experts.recency[handle]
        self._unbucket(experts, handle, int(self.index.hits[handle]))
        expert = self._chosen.pop(handle, None)
        if expert is not None:
            history = experts.history[expert]
            history[self.index.key_of(handle)] = self._clock
            if len(history) > experts.capacity:
                history.popitem(last=False)

    @staticmethod
    def _unbucket(experts: _Experts, handle: int, freq: int) -> None:
        bucket = experts.buckets[freq]
        del bucket[handle]
        if not bucket:
            del experts.buckets[freq]

    def victim(self, tier: Tier) -> int | None:
        experts = self._experts[tier]
        expert = LRU if self._rng.random() < experts.weights[LRU] else LFU
        if expert == LRU:
            found = self._first_unpinned(experts.recency)
        else:
            found = next(
                (h for f in sorted(experts.buckets) if (h := self._first_unpinned(experts.buckets[f])) is not None), None
            )
        if found is not None:
            self._chosen[found] = expert
        return found
