"""LRU that lets the pages of ended sessions go first: what a client's end-of-session hint is worth.

A cache that sees only accesses cannot tell a conversation that paused from one that ended:
sessions return after a think time of unknown length, or never, and the history of a page
says little more than its recency once that is known (docs/sim-eval, "The per-page model
trained on the cluster"). The client can tell: an agent on its last step, a pipeline's
final call, a chat application told the conversation is closed. Production caches take
such hints from their clients (explicit cache control and time-to-live on prompt
prefixes); here a request carries one (:attr:`kvray.core.placement.RequestInfo.ends_session_from`):
it is its session's last, and its pages from that depth on are its own.

This policy is LRU, except that the request's own pages are not stored, its own pages it
hits are ended, a tier's victim is an ended page while it has one (the chain's tail first),
and an ended page is dropped, not demoted: writing a page no one will read to NVMe costs the
drive's time for nothing. A later hit on an ended page (the hint was wrong) makes it an
ordinary page again, so a wrong hint costs misses, never wrong KV.

Example::

    from kvray.core.manager import CacheManager
    from kvray.core.placement import RequestInfo
    from kvray.core.tiers import Tier
    from kvray.policy.session_end import SessionEndLRU

    policy = SessionEndLRU()
    manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, policy)
    policy.on_request(RequestInfo(keys=(7, 8, 9), ends_session_from=1))  # 8 and 9: this session's own, now done
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import LRUPolicy, PageContext, RequestInfo
from kvray.core.tiers import Tier


class SessionEndLRU(LRUPolicy):
    """LRU, with the pages of sessions their clients said are over not stored, evicted first and dropped."""

    name = "lru-session-end"
    needs_session_ends = True

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        self._ended: dict[Tier, OrderedDict[int, None]] = {t: OrderedDict() for t in Tier}
        self._own_from = -1  # the request being served: the depth its own, ended pages start at
        self._ended_hits = self._refused = self._taken = 0

    def on_request(self, info: RequestInfo) -> None:
        self._own_from = info.ends_session_from

    def admit(self, ctx: PageContext) -> Tier | None:
        if 0 <= self._own_from <= ctx.depth:
            self._refused += 1
            return None
        return super().admit(ctx)

    def on_access(self, handles: np.ndarray) -> None:
        super().on_access(handles)
        ended, tier_of = self._ended, self._tier_of
        if self._own_from < 0:
            for h in handles.tolist():
                ended[tier_of[h]].pop(h, None)  # read again: whatever a hint said, it is live
            return
        for h, depth in zip(reversed(handles.tolist()), reversed(self.index.depth[handles].tolist())):  # tail first
            if depth >= self._own_from:
                ended[tier_of[h]][h] = None  # its session's last read
                self._ended_hits += 1
            else:
                ended[tier_of[h]].pop(h, None)

    def on_remove(self, handle: int, tier: Tier) -> None:
        super().on_remove(handle, tier)
        self._ended[tier].pop(handle, None)

    def victim(self, tier: Tier) -> int | None:
        ended = self._first_unpinned(self._ended[tier])
        if ended is None:
            return super().victim(tier)
        self._taken += 1
        return ended

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        return None if handle in self._ended[tier] else super().demote_target(handle, tier)

    def stats(self) -> dict[str, int]:
        """Hits on pages their session ended with, its new pages not stored, ended pages evicted."""
        return {"ended_hits": self._ended_hits, "ended_not_stored": self._refused, "ended_victims": self._taken}
