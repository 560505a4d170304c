"""Selective write-through: a page reaches disk only after it has been hit ``k`` times.

Writing every page that leaves host memory to NVMe spends the drive's write bandwidth on
pages that are never read again (on the shipped traces most new pages are not). SGLang
HiCache's ``write_through_selective`` mode writes a page down a tier only once its hit
count passes a threshold; here a page demoted out of the tier above disk goes to disk when
it has ``k`` hits or more and is dropped otherwise. Eviction order is LRU.

Example::
    from kvray.core.manager import CacheManager
    from kvray.core.tiers import Tier
    from kvray.policy.selective import SelectiveWritePolicy

    manager = CacheManager({Tier.HOST: 1, Tier.DISK: 8}, SelectiveWritePolicy(k=1))
    manager.store_chain([1], mover=lambda *move: None)
    manager.touch(manager.lookup([1]).handles)                 # page 1 has a hit: it earns disk
    manager.store_chain([2], mover=lambda *move: None)         # evicts page 1 down to disk
    manager.store_chain([3], mover=lambda *move: None)         # page 2, never hit, is dropped
    assert manager.lookup([1]).tiers.tolist() == [int(Tier.DISK)] and len(manager.lookup([2])) == 0
"""

from __future__ import annotations

from kvray.core.placement import LRUPolicy
from kvray.core.tiers import Tier


class SelectiveWritePolicy(LRUPolicy):
    """LRU eviction; demotion into the disk tier only for pages hit ``k`` times or more.

    Example::

        manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, SelectiveWritePolicy(k=2))
    """

    name = "selective-write"

    def __init__(self, k: int = 2) -> None:
        if k < 0:
            raise ValueError(f"selective write-through needs k >= 0 hits, got {k}")
        self.k = k

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        below = self._below[tier]
        if below == Tier.DISK and self.index.hits[handle] < self.k:
            return None
        return below
