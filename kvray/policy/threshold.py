"""The threshold rule: long contexts go to the slowest (distributed) tier, high-priority
requests to the device, everything else to host memory; LRU eviction within each tier."""

from __future__ import annotations

from kvray.core.placement import LRUPolicy, PageContext
from kvray.core.tiers import Tier


class ThresholdPolicy(LRUPolicy):
    """Admission by request shape: ``request_pages >= long_context_pages`` -> slowest tier,
    ``priority >= high_priority`` -> device, else host (the nearest present tier in each case).

    Example::

        policy = ThresholdPolicy(long_context_pages=64)   # 32k tokens at 512-token pages
        policy.bind(index, {Tier.DEVICE: 8, Tier.HOST: 64, Tier.DISK: 1024})
        policy.admit(PageContext(depth=0, request_pages=100))   # Tier.DISK
    """

    name = "threshold"

    def __init__(self, long_context_pages: int = 64, high_priority: int = 1) -> None:
        self.long_context_pages = long_context_pages
        self.high_priority = high_priority

    def admit(self, ctx: PageContext) -> Tier | None:
        if ctx.request_pages >= self.long_context_pages:
            return self.tiers[-1]
        if ctx.priority >= self.high_priority:
            return self.nearest(Tier.DEVICE)
        return self.nearest(Tier.HOST)
