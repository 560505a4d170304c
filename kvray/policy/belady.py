"""Belady's furthest-next-use oracle: the best a cache can do, for evaluation only.

It needs the future, which no runtime has: the simulator tells it, before each request,
when each of that request's pages is next used (``RequestInfo.future`` in :meth:`BeladyPolicy.on_request`).
A page never used again is not kept; otherwise the page used furthest in the future is
evicted, the deepest first among pages next used by the same request (a prefix's tail
is worthless without its head).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvray.core.errors import PolicyError
from kvray.core.index import PrefixIndex
from kvray.core.placement import PageContext, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.scored import ScoredPolicy


class BeladyPolicy(ScoredPolicy):
    """Offline optimal eviction by next use; ``on_request`` with the future precedes each request.

    Example::

        policy = BeladyPolicy()
        manager = CacheManager({Tier.HOST: 64}, policy)
        policy.on_request(RequestInfo(keys=(7, 8), future=np.array([12.0, np.inf])))  # 8: never reused
    """

    name = "belady"
    needs_future = True

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._next = np.full(1024, np.inf)
        self._upcoming = np.empty(0)

    def on_request(self, info: RequestInfo) -> None:
        """Learn when each page of the request about to be served is next used."""
        if info.future is None:
            raise PolicyError("belady needs the future of the trace: it runs only in the simulator")
        self._upcoming = np.asarray(info.future, dtype=np.float64)
        self.rescored()
        for key, nxt in zip(info.keys, self._upcoming.tolist()):
            handle = self.index.handle_of(key)
            if handle is not None:
                self._next[handle] = nxt

    def admit(self, ctx: PageContext) -> Tier | None:
        """Keep a page unless it is never used again or, with every tier full, it would be
        the page used furthest ahead (it would be the first to go)."""
        upcoming = self._upcoming[ctx.depth]
        if upcoming == np.inf:
            return None
        if all(len(self.members.handles(t)) >= self.capacities[t] for t in self.tiers):
            victims = [v for v in map(self.victim, self.tiers) if v is not None]  # each tier's furthest
            if victims and upcoming >= self._next[victims].max():
                return None
        return self.tiers[0]

    def on_insert(self, handle: int, tier: Tier) -> None:
        if handle >= len(self._next):
            self._next = np.concatenate([self._next, np.full(len(self._next) + handle, np.inf)])
        super().on_insert(handle, tier)

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        self._next[handle] = self._upcoming[ctx.depth]
        super().on_admitted(handle, ctx)

    def scores(self, handles: np.ndarray | int) -> np.ndarray | float:
        return -(self._next[handles] * 65536.0 + self.index.depth[handles])
