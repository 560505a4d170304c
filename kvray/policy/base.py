"""The placement-policy interface shared by the runtime and the simulator.

A policy answers four questions, each at a decision point of the cache manager:

- ``admit``: where does a new page go (a tier, or None: not kept)?
- ``victim``: a tier is full; which of its pages leaves?
- ``demote_target``: where does that page go (a lower tier, or None: dropped)?
- ``promote_target``: a page was hit in a slow tier; should it move up, and where?

It is told about every change (``on_insert``, ``on_access``, ``on_remove``) so that it can
keep whatever ordering it needs. It reads page state (pins, heat, depth) from the shared
:class:`~kvray.index.PrefixIndex` and never moves bytes: the manager does that, and in the
simulator a cost model stands in for the bytes (DESIGN.md, seam 2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvray.index import PrefixIndex
from kvray.tiers import Tier


@dataclass(frozen=True)
class PageContext:
    """What is known online about a page being stored."""

    depth: int
    request_pages: int
    priority: int = 0
    tenant: str = ""


class PlacementPolicy(ABC):
    """Base class of placement policies.

    Subclasses set ``name`` and implement the ordering hooks and ``victim``; the default
    admission puts a page in the fastest tier and the default demotion walks down the tiers.

    Example::

        policy = LRUPolicy()
        policy.bind(index, {Tier.HOST: 128, Tier.DISK: 4096})
        policy.admit(PageContext(depth=0, request_pages=4))   # Tier.HOST
    """

    name: ClassVar[str] = "base"

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        """Attach to the index and tier sizes of the manager that consults this policy."""
        self.index = index
        self.tiers = sorted(t for t, cap in capacities.items() if cap > 0)
        self.capacities = dict(capacities)

    def admit(self, ctx: PageContext) -> Tier | None:
        return self.tiers[0]

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        lower = [t for t in self.tiers if t > tier]
        return lower[0] if lower else None

    def promote_target(self, handle: int, tier: Tier) -> Tier | None:
        return None

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
        pins = self.index.pins
        return next((h for h in handles if pins[h] == 0), None)
