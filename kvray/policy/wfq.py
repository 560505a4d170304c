"""Weighted fair sharing of each tier between tenants (or sessions), WFQ-style.

Every flow (``PageContext.tenant``) is entitled to a share of a tier proportional to its
weight ``1 + priority``; when the tier is full, the flow furthest over its share (most
pages per unit of weight) gives up its least recently used unpinned page. One long
document cannot flush everyone else's prefixes, and higher-priority tenants keep more.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PageContext, PlacementPolicy
from kvray.core.tiers import Tier


class WFQPolicy(PlacementPolicy):
    """Evict from the flow with the most pages per weight in the tier; LRU inside a flow.

    Example::

        policy = WFQPolicy()
        manager = CacheManager({Tier.HOST: 64}, policy)
        ctx = PageContext(depth=0, request_pages=4, priority=2, tenant="a")
        manager.complete_store(key, Tier.HOST, slot, 0, parent=ROOT, ctx=ctx)
    """

    name = "wfq"

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._flows: dict[Tier, dict[str, OrderedDict[int, None]]] = {t: {} for t in self.tiers}
        self._heap: dict[Tier, list[tuple[float, str]]] = {t: [] for t in self.tiers}
        self._weight: dict[str, float] = {}
        self._flow_of: dict[int, str] = {}
        self._moving: int | None = None  # key of a page between on_remove and on_insert of a move

    def _place(self, handle: int, tier: Tier, flow: str) -> None:
        pages = self._flows[tier].setdefault(flow, OrderedDict())
        pages[handle] = None
        self._flow_of[handle] = flow
        self._push(tier, flow)

    def _push(self, tier: Tier, flow: str) -> None:
        heap = self._heap[tier]
        heapq.heappush(heap, (-len(self._flows[tier][flow]) / self._weight.get(flow, 1.0), flow))
        if len(heap) > 4 * len(self._flows[tier]) + 64:  # drop stale entries now and then
            self._heap[tier] = [(-len(p) / self._weight.get(f, 1.0), f) for f, p in self._flows[tier].items()]
            heapq.heapify(self._heap[tier])

    def on_insert(self, handle: int, tier: Tier) -> None:
        moved = self._moving == self.index.key_of(handle)
        self._place(handle, tier, self._flow_of.get(handle, "") if moved else "")

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        tier = Tier(int(self.index.tier[handle]))
        self._weight[ctx.tenant] = max(self._weight.get(ctx.tenant, 1.0), 1.0 + ctx.priority)
        self.on_remove(handle, tier)
        self._place(handle, tier, ctx.tenant)

    def on_access(self, handles: np.ndarray) -> None:
        tiers = self.index.tier[handles].tolist()
        for h, t in zip(reversed(handles.tolist()), reversed(tiers)):
            self._flows[Tier(t)][self._flow_of[h]].move_to_end(h)

    def on_remove(self, handle: int, tier: Tier) -> None:
        flow = self._flow_of[handle]
        pages = self._flows[tier][flow]
        del pages[handle]
        if pages:
            self._push(tier, flow)
        else:
            del self._flows[tier][flow]
        self._moving = self.index.key_of(handle)

    def victim(self, tier: Tier) -> int | None:
        heap, flows, skipped = self._heap[tier], self._flows[tier], []
        found = None
        while heap and found is None:
            share, flow = heapq.heappop(heap)
            pages = flows.get(flow)
            if pages is None or share != -len(pages) / self._weight.get(flow, 1.0):
                continue  # stale entry
            skipped.append((share, flow))
            found = self._first_unpinned(pages)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found
