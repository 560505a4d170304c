"""S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO per tier.

Most pages of a workload are read once in a short window (one-hit wonders); S3-FIFO lets
them leave quickly without ordering anything on a hit. A page entering a tier goes to the
small queue (a tenth of the tier), unless its key is in the tier's ghost queue (it left the
small queue recently and came back: it is reused), then to the main queue. A hit only
raises the page's 2-bit frequency (capped at 3). To evict, while the small queue holds its
share or more its oldest page leaves, unless it was hit there (frequency above 0): then it
moves to the main queue instead, its count reset. Otherwise the main queue's oldest page
leaves unless it was hit: then it goes back to the head with its count lowered by one
(FIFO with reinsertion). Keys that leave the small queue are remembered in the ghost queue,
as many as the main queue holds.

In kvray a victim must be unpinned: pinned pages are passed over where they are. A page
demoted into a tier enters that tier as a new one (through its ghost if it is there), and
what a victim takes with it is the prefix index's to say, as for every policy.

Example::
    from kvray.core.manager import CacheManager
    from kvray.core.tiers import Tier
    from kvray.policy.s3fifo import S3FIFOPolicy

    manager = CacheManager({Tier.HOST: 3}, S3FIFOPolicy())
    for key in (1, 2, 3, 4):                                  # 1, never hit, leaves the small queue
        manager.store_chain([key], mover=lambda *move: None)
    manager.store_chain([1], mover=lambda *move: None)        # a ghost: it enters the main queue
    assert 1 in manager.index and 2 not in manager.index
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import Tier

MAX_FREQUENCY = 3  # a 2-bit counter


class _Queues:
    """One tier's small, main and ghost queues, oldest first."""

    def __init__(self, capacity: int, small_share: float) -> None:
        self.small_target = max(1, round(small_share * capacity))
        self.ghost_capacity = max(1, capacity - self.small_target)
        self.small: OrderedDict[int, None] = OrderedDict()  # handles
        self.main: OrderedDict[int, None] = OrderedDict()  # handles
        self.ghost: OrderedDict[int, None] = OrderedDict()  # keys: handles are reused

    def remember(self, key: int) -> None:
        self.ghost[key] = None
        self.ghost.move_to_end(key)
        if len(self.ghost) > self.ghost_capacity:
            self.ghost.popitem(last=False)


class S3FIFOPolicy(PlacementPolicy):
    """S3-FIFO eviction in every tier; demote one tier down.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, S3FIFOPolicy())
    """

    name = "s3fifo"
    small_share: ClassVar[float] = 0.1

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._queues = {t: _Queues(capacities[t], self.small_share) for t in self.tiers}
        self._frequency: dict[int, int] = {}  # handle -> hits since it entered its queue, up to MAX_FREQUENCY

    def on_insert(self, handle: int, tier: Tier) -> None:
        queues, key = self._queues[tier], self.index.key_of(handle)
        if key in queues.ghost:
            del queues.ghost[key]
            queues.main[handle] = None
        else:
            queues.small[handle] = None
        self._frequency[handle] = 0

    def on_access(self, handles: np.ndarray) -> None:
        frequency = self._frequency
        for h in handles.tolist():
            frequency[h] = min(frequency[h] + 1, MAX_FREQUENCY)

    def on_remove(self, handle: int, tier: Tier) -> None:
        queues = self._queues[tier]
        if handle in queues.small:
            del queues.small[handle]
            queues.remember(self.index.key_of(handle))
        else:
            del queues.main[handle]
        del self._frequency[handle]

    def hand_over(self, tier: Tier, pages: np.ndarray, read: np.ndarray) -> None:
        """Rebuild ``tier``'s queues from the pages it holds (``pages``, oldest first; ``read``:
        which were read since stored): the read ones in the main queue, the others in the
        small queue, each in that order, their counts kept, the ghost kept. Why: an S3-FIFO
        told of a cache it does not evict (the tripwire's advisor while the model decides)
        never scans its small queue, so that queue grows to hold most of the cache in
        insertion order; handed the cache, it would evict as if those pages had just
        arrived (docs/sim-eval, "The tripwire's hand-over")."""
        queues = self._queues[tier]
        order = pages.tolist()
        queues.small = OrderedDict((h, None) for h, r in zip(order, read.tolist()) if not r)
        queues.main = OrderedDict((h, None) for h, r in zip(order, read.tolist()) if r)

    def victim(self, tier: Tier) -> int | None:
        queues = self._queues[tier]
        if len(queues.small) >= queues.small_target:
            found = self._from_small(queues)
            if found is not None:
                return found
        found = self._from_main(queues)
        return found if found is not None else self._from_small(queues)  # main had no unpinned page

    def _oldest_not_hit(self, queue: dict[int, None]) -> tuple[int | None, list[int]]:
        """The oldest unpinned page of ``queue`` with no hit left, and the hit unpinned pages
        met before it, oldest first (the caller moves those on)."""
        pins, frequency = self.index.pins, self._frequency
        hit = []
        for h in queue:
            if pins.item(h):
                continue
            if not frequency[h]:
                return h, hit
            hit.append(h)
        return None, hit

    def _from_small(self, queues: _Queues) -> int | None:
        """The small queue's oldest unpinned page not hit there; the hit ones met on the way
        move to the main queue."""
        frequency = self._frequency
        found, hit = self._oldest_not_hit(queues.small)
        for h in hit:
            del queues.small[h]
            queues.main[h] = None
            frequency[h] = 0
        return found

    def _from_main(self, queues: _Queues) -> int | None:
        """The main queue's oldest unpinned page not hit since it was last passed; the hit
        ones met on the way go back to the head, one hit fewer."""
        frequency = self._frequency
        for _ in range(MAX_FREQUENCY + 1):  # each pass lowers every unpinned page's count
            found, hit = self._oldest_not_hit(queues.main)
            for h in hit:
                frequency[h] -= 1
                queues.main.move_to_end(h)
            if found is not None or not hit:
                return found
        return None
