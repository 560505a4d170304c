"""Promotion on a disk read, and heuristics that do it: the reference for what it alone is worth.

Every eviction rule here reorders a tier by its reads and moves a page only down; a page
demoted to disk while it was cold stays there as long as it is read, since each read makes
it the newest of the disk tier, and every read of it is a disk load held on the prefill
engine. :data:`PROMOTE` moves a page read from disk up to host memory (the victim made room
for there goes down by the policy's own rule). The per-page policy promotes the disk reads
its model says pay for (:meth:`~kvray.policy.reuse.ReusePolicy.promote_target`);
:func:`promoting` gives a heuristic the rule for every disk read, so an evaluation can tell
how much of a gain is the promotion and how much the ranking (docs/sim-eval, "Promotion"),
and the tripwire can follow a heuristic that promotes.

Example::

    from kvray.core.placement import LRUPolicy
    from kvray.core.tiers import Tier
    from kvray.policy.promote import promoting

    policy = promoting(LRUPolicy)()
    assert policy.promote_target(0, Tier.DISK) == Tier.HOST and policy.name == "lru-promote"
"""

from __future__ import annotations

from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import Tier

PROMOTE = {Tier.DISK: Tier.HOST}  # a page read from disk moves up to host memory


def promote_target(tier: Tier) -> Tier | None:
    """Where a page read from ``tier`` moves (None: it stays)."""
    return PROMOTE.get(tier)


def promoting(policy: type[PlacementPolicy]) -> type[PlacementPolicy]:
    """``policy`` with :data:`PROMOTE` (its name suffixed ``-promote``)."""

    def target(self: PlacementPolicy, handle: int, tier: Tier) -> Tier | None:
        return promote_target(tier)

    return type(f"Promoting{policy.__name__}", (policy,), {"promote_target": target, "name": f"{policy.name}-promote"})
