"""SIEVE (Zhang et al., NSDI'24): one FIFO queue per tier, a visited bit and a moving hand.

A page enters its tier's queue at the head, unvisited; a hit only sets its visited bit (no
reordering, so a hit costs O(1) and moves nothing). To evict, a hand walks from the tail
(oldest) toward the head: a visited page keeps its place and loses its bit, the first
unvisited one leaves. The hand stays where it stopped and wraps to the tail past the head,
so a page survives the hand's next pass only if it was hit since the last one: new pages
that are never read again leave quickly, pages in use stay without being moved.

In kvray a victim must be unpinned: the hand passes over pinned pages without clearing
their bit. A page demoted into a tier enters that tier's queue like a new one. The prefix
index decides what a victim takes with it (its descendants, in the last tier), as for every
policy.

Example::
    from kvray.core.manager import CacheManager
    from kvray.core.tiers import Tier
    from kvray.policy.sieve import SievePolicy

    manager = CacheManager({Tier.HOST: 2}, SievePolicy())
    manager.store_chain([1], mover=lambda *move: None)
    manager.store_chain([2], mover=lambda *move: None)
    manager.touch(manager.lookup([1]).handles)                # 1 is visited
    manager.store_chain([3], mover=lambda *move: None)        # the hand spares 1, takes 2
    assert 1 in manager.index and 2 not in manager.index
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import Tier


class _SieveQueue:
    """One tier's queue: a doubly linked list of handles (newest at the head), the visited
    set and the hand (None: start at the tail)."""

    def __init__(self) -> None:
        self.newer: dict[int, int | None] = {}  # handle -> the next page toward the head
        self.older: dict[int, int | None] = {}  # handle -> the next page toward the tail
        self.head: int | None = None
        self.tail: int | None = None
        self.hand: int | None = None
        self.visited: set[int] = set()

    def __len__(self) -> int:
        return len(self.newer)

    def push(self, handle: int) -> None:
        self.newer[handle], self.older[handle] = None, self.head
        if self.head is not None:
            self.newer[self.head] = handle
        else:
            self.tail = handle
        self.head = handle

    def remove(self, handle: int) -> None:
        newer, older = self.newer.pop(handle), self.older.pop(handle)
        if self.hand == handle:
            self.hand = newer  # the hand moves on toward the head
        if newer is not None:
            self.older[newer] = older
        else:
            self.head = older
        if older is not None:
            self.newer[older] = newer
        else:
            self.tail = newer
        self.visited.discard(handle)


class SievePolicy(PlacementPolicy):
    """SIEVE eviction in every tier; demote one tier down.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, SievePolicy())
    """

    name = "sieve"

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._queues = {t: _SieveQueue() for t in self.tiers}

    def on_insert(self, handle: int, tier: Tier) -> None:
        self._queues[tier].push(handle)

    def on_access(self, handles: np.ndarray) -> None:
        queues = self._queues  # keyed by Tier, an IntEnum: the tier numbers find them
        for h, tier in zip(handles.tolist(), self.index.tier[handles].tolist()):
            queues[tier].visited.add(h)

    def on_remove(self, handle: int, tier: Tier) -> None:
        self._queues[tier].remove(handle)

    def victim(self, tier: Tier) -> int | None:
        queue = self._queues[tier]
        pins, visited, newer = self.index.pins, queue.visited, queue.newer
        handle = queue.hand if queue.hand is not None else queue.tail
        for _ in range(2 * len(queue)):  # one pass clears every bit; the next finds an unpinned page if any
            if pins.item(handle) == 0:
                if handle not in visited:
                    queue.hand = handle
                    return handle
                visited.discard(handle)
            handle = newer[handle]
            if handle is None:
                handle = queue.tail
        queue.hand = handle
        return None
