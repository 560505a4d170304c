"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), one instance per tier.

Each tier keeps pages seen once (T1) apart from pages hit again (T2), remembers the keys
recently evicted from each (ghosts B1, B2), and moves its target size for T1 toward
whichever ghost list is being re-requested: recency-heavy and frequency-heavy phases of a
workload each get the split that suits them. A page leaving a tier (demoted or dropped)
becomes that tier's ghost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import Tier


class _ArcLists:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def remember(self, ghosts: OrderedDict[int, None], key: int) -> None:
        ghosts[key] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)


class ARCPolicy(PlacementPolicy):
    """ARC eviction in every tier; demote one tier down.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, ARCPolicy())
    """

    name = "arc"

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._lists = {t: _ArcLists(capacities[t]) for t in self.tiers}
        self.ghost_hits = 0  # pages stored again while remembered as ghosts: recency or frequency was wrong

    def on_insert(self, handle: int, tier: Tier) -> None:
        arc, key = self._lists[tier], self.index.key_of(handle)
        if key in arc.b1 or key in arc.b2:
            self.ghost_hits += 1
        if key in arc.b1:
            arc.p = min(arc.capacity, arc.p + max(1.0, len(arc.b2) / len(arc.b1)))
            del arc.b1[key]
            arc.t2[handle] = None
        elif key in arc.b2:
            arc.p = max(0.0, arc.p - max(1.0, len(arc.b1) / len(arc.b2)))
            del arc.b2[key]
            arc.t2[handle] = None
        else:
            arc.t1[handle] = None

    def on_access(self, handles: np.ndarray) -> None:
        tiers = self.index.tier[handles].tolist()
        for h, tier in zip(reversed(handles.tolist()), reversed(tiers)):  # deepest first: the root ends most recent
            arc = self._lists[Tier(tier)]
            if h in arc.t1:
                del arc.t1[h]
                arc.t2[h] = None
            else:
                arc.t2.move_to_end(h)

    def on_remove(self, handle: int, tier: Tier) -> None:
        arc, key = self._lists[tier], self.index.key_of(handle)
        if handle in arc.t1:
            del arc.t1[handle]
            arc.remember(arc.b1, key)
        else:
            del arc.t2[handle]
            arc.remember(arc.b2, key)

    def victim(self, tier: Tier) -> int | None:
        arc = self._lists[tier]
        first, second = (arc.t1, arc.t2) if len(arc.t1) > arc.p or not arc.t2 else (arc.t2, arc.t1)
        found = self._first_unpinned(first)
        return found if found is not None else self._first_unpinned(second)
