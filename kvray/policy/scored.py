"""Policies that evict by a score: the lowest-scored unpinned page of a tier leaves first.

:class:`ScoredPolicy` keeps each tier's members as a dense array (:class:`TierMembers`) so
that a subclass scores them vectorised from the index columns (heat, recency, depth), and a
short queue of each tier's lowest scores so that an eviction does not rescore the tier.
"""

from __future__ import annotations

import bisect
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from typing import ClassVar

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PageContext, PlacementPolicy
from kvray.core.tiers import Tier


class TierMembers:
    """The pages of each tier as a dense handle array, for vectorised scoring.

    Removal swaps the last member into the hole, so add and remove are O(1) and a tier's
    members are always ``handles(tier)`` without a Python-level walk.
    """

    def __init__(self, capacities: Mapping[Tier, int]) -> None:
        self._members = {t: np.empty(max(cap, 1), dtype=np.int64) for t, cap in capacities.items()}
        self._count = dict.fromkeys(capacities, 0)
        self._pos: dict[int, int] = {}

    def add(self, handle: int, tier: Tier) -> None:
        n = self._count[tier]
        members = self._members[tier]
        if n == len(members):
            self._members[tier] = members = np.concatenate([members, np.empty_like(members)])
        members[n] = handle
        self._pos[handle] = n
        self._count[tier] = n + 1

    def remove(self, handle: int, tier: Tier) -> None:
        i = self._pos.pop(handle)
        last = self._count[tier] - 1
        members = self._members[tier]
        if i != last:
            moved = int(members[last])
            members[i] = moved
            self._pos[moved] = i
        self._count[tier] = last

    def handles(self, tier: Tier) -> np.ndarray:
        return self._members[tier][: self._count[tier]]


class ScoredPolicy(PlacementPolicy):
    """Evicts the unpinned page with the lowest ``scores`` in its tier.

    Subclasses define ``scores(handles)`` from the index columns (heat, recency, depth) or
    from what they know; scores must change only on ``on_access`` or when a subclass calls
    :meth:`rescored`. Scoring a whole tier per eviction would cost O(tier) each time, so
    each tier keeps a short queue of its lowest-scored pages; the queue stays exact because
    it is dropped whenever a score changes (or, for scores that only rise on access, loses
    the pages touched), a page scoring below its last entry joins it in order, and an entry
    counts only while its page has not left the tier since (so its score is the one queued).
    Pinned pages stay queued but are passed over, so that they count again once unpinned.

    Example::

        class Oldest(ScoredPolicy):
            def scores(self, handles):
                return self.index.last_access[handles].astype(float)
    """

    queue_length: ClassVar[int] = 64
    # True when an access can only raise the scores of the pages it touches (LFU): the
    # queue then stays exact by forgetting just those pages instead of being rebuilt.
    scores_rise_on_access: ClassVar[bool] = False

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self.members = TierMembers({t: capacities[t] for t in self.tiers})
        self._queues: dict[Tier, list[tuple[float, int]]] = {}
        self._queued: dict[int, Tier] = {}  # handle -> the tier whose queue holds it, while it stays there

    @abstractmethod
    def scores(self, handles: np.ndarray | int) -> np.ndarray | float:
        """Eviction scores (lowest leaves first) of an array of handles, or of one handle."""

    def rescored(self, handles: Iterable[int] | None = None) -> None:
        """Scores changed (of ``handles``, or of any page when None): queues are stale."""
        self._queues.clear()
        self._queued.clear()

    def on_insert(self, handle: int, tier: Tier) -> None:
        self.members.add(handle, tier)
        self._check_newcomer(handle, tier)

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        self._check_newcomer(handle, Tier(int(self.index.tier[handle])))

    def _check_newcomer(self, handle: int, tier: Tier) -> None:
        queue = self._queues.get(tier)
        if not queue or self._queued.get(handle) == tier:
            return
        if any(queued == handle for _, queued in queue):
            if self.scores(handle) < queue[-1][0]:
                self._drop_queue(tier)  # its entry from an earlier stay would count again
            return
        self._enqueue(handle, tier, queue)

    def _enqueue(self, handle: int, tier: Tier, queue: list[tuple[float, int]]) -> None:
        """Queue a page in order if it scores below the last entry (else it is not needed)."""
        score = float(self.scores(handle))
        if score < queue[-1][0]:
            bisect.insort(queue, (score, handle))  # demoted pages are often the lowest (LFU)
            self._queued[handle] = tier

    def _drop_queue(self, tier: Tier) -> None:
        for _, handle in self._queues.pop(tier):
            if self._queued.get(handle) == tier:
                del self._queued[handle]

    def on_access(self, handles: np.ndarray) -> None:
        if not self.scores_rise_on_access:
            self.rescored(handles)
            return
        queued = self._queued
        moved = {h: queued.pop(h) for h in handles.tolist() if h in queued}
        for tier in set(moved.values()):  # pages outside the queue rose and still score above it
            queue = self._queues[tier]
            queue[:] = [entry for entry in queue if entry[1] not in moved]
            if queue:
                for handle in (h for h, t in moved.items() if t == tier):
                    self._enqueue(handle, tier, queue)
            else:
                del self._queues[tier]

    def on_remove(self, handle: int, tier: Tier) -> None:
        self.members.remove(handle, tier)
        self._queued.pop(handle, None)

    def victim(self, tier: Tier) -> int | None:
        queued, pins = self._queued, self.index.pins
        queue = self._queues.get(tier)
        while queue and queued.get(queue[0][1]) != tier:  # stale: asking twice gives the same answer
            queue.pop(0)
        if not queue:
            queue = self._queues[tier] = self._lowest(tier, self.queue_length)
            queued.update((handle, tier) for _, handle in queue)
        for _, handle in queue:  # pinned pages stay queued: they may be unpinned by the next call
            if pins[handle] == 0 and queued.get(handle) == tier:
                return handle
        rest = self._lowest(tier, 1, unpinned=True)  # every queued page is pinned
        return rest[0][1] if rest else None

    def _lowest(self, tier: Tier, k: int, unpinned: bool = False) -> list[tuple[float, int]]:
        """The ``k`` lowest-scored pages of ``tier`` (only unpinned ones if asked), lowest first."""
        handles = self.members.handles(tier)
        if unpinned:
            handles = handles[self.index.pins[handles] == 0]
        if len(handles) == 0:
            return []
        scores = np.asarray(self.scores(handles), dtype=np.float64)
        k = min(k, len(handles))
        part = np.argpartition(scores, k - 1)[:k] if k < len(handles) else np.arange(len(handles))
        part = part[np.lexsort((handles[part], scores[part]))]
        return list(zip(scores[part].tolist(), handles[part].tolist()))
