"""The placement seam: the interface the cache manager consults, and LRU, its default.

A policy answers four questions, each at a decision point of the cache manager:

- ``admit``: where does a new page go (a tier, or None: not kept)?
- ``victim``: a tier is full; which of its pages leaves?
- ``demote_target``: where does that page go (a lower tier, or None: dropped)?
- ``promote_target``: a page was hit in a slow tier; should it move up, and where?

It is told about every change (``on_insert``, ``on_access``, ``on_remove``) so that it can
keep whatever ordering it needs. It reads page state (pins, heat, depth) from the shared
:class:`~kvray.core.index.PrefixIndex` and never moves bytes: the manager does that, and in the
simulator a cost model stands in for the bytes (docs/design.md, "One policy, two worlds").

The core holds only this seam and the one heuristic a :class:`~kvray.core.store.PageStore`
falls back on; the other heuristics, the learned policy and the registry that builds them by
name live in :mod:`kvray.policy`, above the core, and reach the core as objects.

Example::
    from kvray.core.index import PrefixIndex
    from kvray.core.placement import LRUPolicy, PageContext
    from kvray.core.tiers import Tier

    policy = LRUPolicy()
    policy.bind(PrefixIndex(), {Tier.HOST: 128, Tier.DISK: 4096})
    assert policy.admit(PageContext(depth=0, request_pages=4)) == Tier.HOST
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.tiers import Tier


@dataclass(frozen=True)
class RequestInfo:
    """What the cache knows as a request arrives, told to the policy before it is served.

    ``tier_cost`` is each tier's time to bring a page to the engine relative to
    recomputing it (prefill); ``backlog_ms`` the work queued ahead (load). Where the cost
    of time is known (the simulator), ``arrival_ms``, ``page_prefill_ms`` (recomputing one
    page) and ``engines`` (prefill engines serving the queue) let a policy model what a
    choice would have cost in waiting, not only in pages; ``page_prefill_ms`` 0 means
    unknown. ``future`` is
    set only by the simulator, only for the offline oracle: per page of the request, the
    index of the next request that uses it (``inf`` if none), and ``index`` the request's own
    (a cluster node hears of only some requests, so its own count is not the trace's clock).
    ``load_util`` (simulator, to a policy that asks: ``needs_link_util``) is each tier's
    load path's recent busy share, its busiest link's, on the node told (0 on links that
    never queue: a single-node scenario's, unless it says ``links: {queued: true}``).
    """

    keys: tuple[int, ...]
    backlog_ms: float = 0.0
    tier_cost: Mapping[Tier, float] | None = None
    future: np.ndarray | None = None
    arrival_ms: float = 0.0
    page_prefill_ms: float = 0.0
    engines: int = 1
    disk_write_util: float = 0.0  # the NVMe write link's recent busy share (0 if it never queues), to a disk gate
    index: int = -1  # the request's position in the trace, with ``future`` (-1: not told)
    load_util: Mapping[Tier, float] | None = None
    # A client's hint: this request is its session's last, and its pages from this depth on are
    # its own (no other session shares them), so no later request reads them (-1: no hint)
    ends_session_from: int = -1


@dataclass(frozen=True)
class PageContext:
    """What is known online about a page being stored (``key``: its key, where the caller has
    it, so a policy told of pages by key, as by an end-of-session hint, knows the page)."""

    depth: int
    request_pages: int
    priority: int = 0
    tenant: str = ""
    key: int | None = None


class RunPlace(NamedTuple):
    """Where a run of pages a cluster node stores sits in its request's chain: its first
    page's depth and the request's length, which the node's policy is told of each page
    (:class:`PageContext`) as the simulator tells it, the chain being spread over nodes."""

    first_depth: int
    request_pages: int


class PlacementPolicy(ABC):
    """Base class of placement policies.

    Subclasses set ``name`` and implement the ordering hooks and ``victim``; the default
    admission puts a page in the fastest tier and the default demotion walks down the tiers
    (the module's example binds one).
    """

    name: ClassVar[str] = "base"
    needs_future: ClassVar[bool] = False  # an offline oracle: only the simulator can run it
    needs_disk_util: bool = False  # told the NVMe write link's queue with each request (RequestInfo.disk_write_util)
    needs_link_util: bool = False  # told each tier's load path's queue with each request (RequestInfo.load_util)
    needs_session_ends: ClassVar[bool] = False  # told the clients' end-of-session hints (RequestInfo.ends_session_from)
    # The simulator's compiled chain writer (kvray/sim/_chain.c) may run the manager's part of a
    # store and call this policy's hooks: true where demote_target depends neither on pins nor
    # on the order it is asked about a chain's kept pages in (the writer asks in another order)
    compiled_chain: bool = True
    # ... and keep this policy's own bookkeeping there, in C (kvray/sim/_chain_reuse.h: the reuse policy's)
    native_hooks: bool = False

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        """Attach to the index and tier sizes of the manager that consults this policy."""
        self.index = index
        self.tiers = sorted(t for t, cap in capacities.items() if cap > 0)
        self.capacities = dict(capacities)
        self._below = {t: next((s for s in self.tiers if s > t), None) for t in Tier}

    def admit(self, ctx: PageContext) -> Tier | None:
        return self.tiers[0]

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        return self._below[tier]

    def promote_target(self, handle: int, tier: Tier) -> Tier | None:
        return None

    def on_request(self, info: RequestInfo) -> None:
        """A request is about to be served (before its lookup)."""

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        """A new page was stored with ``ctx`` (after ``on_insert``); policies that keep
        per-page context (tenant, priority) record it here."""

    def stats(self) -> dict[str, int]:
        """Counts of what the policy did that a replay's hits and times do not show (a learned
        policy's online refits, the times its tripwire handed the cache to a heuristic), so a
        user can tell the learned part ran; empty for a fixed rule. Replays sum them over nodes."""
        return {}

    def nearest(self, tier: Tier) -> Tier:
        """The present tier closest to ``tier``: itself, else the next slower, else the slowest."""
        return next((t for t in self.tiers if t >= tier), self.tiers[-1])

    @abstractmethod
    def on_insert(self, handle: int, tier: Tier) -> None: ...

    @abstractmethod
    def on_access(self, handles: np.ndarray) -> None:
        """Pages of one request were hit, root first."""

    @abstractmethod
    def on_remove(self, handle: int, tier: Tier) -> None: ...

    @abstractmethod
    def victim(self, tier: Tier) -> int | None:
        """An unpinned page of ``tier`` to evict, or None when every page is pinned."""

    def _first_unpinned(self, handles: Iterable[int]) -> int | None:
        pin_count = self.index.pins.item  # a Python int per read, not a numpy scalar
        for h in handles:  # a loop, not next(genexpr): this runs once per eviction
            if pin_count(h) == 0:
                return h
        return None


class LRUPolicy(PlacementPolicy):
    """Evict the least recently used unpinned page of a tier; demote one tier down.

    A request's hit pages are touched deepest first, so its root pages are the most recent:
    within one prefix the tail leaves before the head, as in a radix-tree cache.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, LRUPolicy())
    """

    name = "lru"

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
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
