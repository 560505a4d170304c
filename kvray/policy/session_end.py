"""End-of-session hints in a placement policy: the pages of sessions their clients said are over go first.

A cache that sees only accesses cannot tell a conversation that paused from one that ended:
sessions return after a think time of unknown length, or never, and the history of a page
says little more than its recency once that is known (docs/sim-eval, "The per-page model
trained on the cluster"). The client can tell: an agent on its last step, a pipeline's
final call, a chat application told the conversation is closed. Production caches take
such hints from their clients (explicit cache control and time-to-live on prompt
prefixes); here a request carries one (:attr:`kvray.core.placement.RequestInfo.ends_session_from`):
it is its session's last, and its pages from that depth on are its own.

:class:`SessionEnds` adds the hint to any eviction rule: the request's own pages are not
stored, its own pages it hits are ended, a tier's victim is an ended page while it has one
(the chain's tail first), and an ended page is dropped, not demoted, nor promoted from disk:
writing a page no one will read to NVMe, or moving it up, costs a link's time for nothing. A later hit on an ended page (the hint
was wrong) makes it an ordinary page again, so a wrong hint costs misses, never wrong KV.
:class:`SessionEndLRU` (``lru-session-end``) is LRU with it, what the hint alone is worth;
:func:`ending_sessions` gives it to another rule (``reuse-session-end``: the per-page
learned policy, which keeps its own ranking for every page no hint names).

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

import functools
from collections import OrderedDict
from collections.abc import Mapping
from typing import ClassVar, TypeVar

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import LRUPolicy, PageContext, PlacementPolicy, RequestInfo
from kvray.core.tiers import Tier

Rule = TypeVar("Rule", bound=PlacementPolicy)


class SessionEnds:
    """The hints' part of a policy (see the module docstring), put before an eviction rule's
    class in the bases (:func:`ending_sessions`): each hook does the hint's work around the rule's."""

    needs_session_ends = True
    # Own pages told and not yet seen here, by key: a request's hint holds until its pages are
    # hit or stored, whatever other requests a store serves meanwhile (a runtime store serves
    # several at once); bounded, as pages a hint names may be served by other nodes only.
    told_keys_kept: ClassVar[int] = 1 << 16
    index: PrefixIndex

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)  # type: ignore[misc]
        self._ended: dict[int, OrderedDict[int, None]] = {t: OrderedDict() for t in Tier}
        self._told: OrderedDict[int, None] = OrderedDict()
        self._moving: tuple[int, int] | None = None  # an ended page between its two tiers: (handle, key)
        self._ended_hits = self._refused = self._taken = 0

    def on_request(self, info: RequestInfo) -> None:
        super().on_request(info)  # type: ignore[misc]
        if info.ends_session_from < 0:
            return
        told = self._told
        for key in info.keys[info.ends_session_from :]:
            told[key] = None
        while len(told) > self.told_keys_kept:
            told.popitem(last=False)

    def admit(self, ctx: PageContext) -> Tier | None:
        self._moving = None  # a store, not the second half of a move
        if ctx.key is not None and self._take_told(ctx.key):  # a session's own page, after its last request
            self._refused += 1
            return None
        return super().admit(ctx)  # type: ignore[misc]

    def on_access(self, handles: np.ndarray) -> None:
        super().on_access(handles)  # type: ignore[misc]
        ended, tier_of, key_of = self._ended, self.index.tier, self.index.key_of
        for h in reversed(handles.tolist()):  # the tail first, as it should leave
            if self._told and self._take_told(key_of(h)):
                ended[tier_of.item(h)][h] = None  # its session's last read
                self._ended_hits += 1
            else:
                ended[tier_of.item(h)].pop(h, None)  # read again: whatever a hint said, it is live

    def _take_told(self, key: int) -> bool:
        """Whether a hint named ``key`` (and forget it: a hint is used once, by a hit or a store)."""
        if key not in self._told:
            return False
        del self._told[key]
        return True

    def on_insert(self, handle: int, tier: Tier) -> None:
        super().on_insert(handle, tier)  # type: ignore[misc]
        if self._moving is not None and self._moving == (handle, self.index.key_of(handle)):
            self._ended[tier][handle] = None  # moved, not read: still ended
        self._moving = None

    def on_remove(self, handle: int, tier: Tier) -> None:
        super().on_remove(handle, tier)  # type: ignore[misc]
        ended = self._ended[tier]
        self._moving = (handle, self.index.key_of(handle)) if handle in ended else None
        ended.pop(handle, None)

    def victim(self, tier: Tier) -> int | None:
        ended = self._first_unpinned(self._ended[tier])  # type: ignore[attr-defined]
        if ended is None:
            return super().victim(tier)  # type: ignore[misc]
        self._taken += 1
        return ended

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        return None if handle in self._ended[tier] else super().demote_target(handle, tier)  # type: ignore[misc]

    def promote_target(self, handle: int, tier: Tier) -> Tier | None:
        """An ended page read from disk stays there: moving it up would cost a disk read, a host
        write and a live host page pushed down, for a page no one reads again."""
        return None if handle in self._ended[tier] else super().promote_target(handle, tier)  # type: ignore[misc]

    def stats(self) -> dict[str, int]:
        """The rule's own counts, and: hits on a session's own pages by its last request, stores of
        its new ones refused (a chain's store stops at its first refused page), ended pages evicted."""
        own = super().stats()  # type: ignore[misc]
        return {**own, "ended_hits": self._ended_hits, "ended_stores_refused": self._refused, "ended_victims": self._taken}


@functools.cache
def ending_sessions(policy: type[Rule]) -> type[Rule]:
    """``policy`` told the end-of-session hints (its name suffixed ``-session-end``); one class per rule."""
    return type(f"SessionEnd{policy.__name__}", (SessionEnds, policy), {"name": f"{policy.name}-session-end"})


class SessionEndLRU(SessionEnds, LRUPolicy):
    """LRU, with the pages of sessions their clients said are over not stored, evicted first and dropped."""

    name = "lru-session-end"
