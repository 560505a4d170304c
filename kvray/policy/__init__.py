"""Placement policies and their registry.

``make_policy("lru")`` builds a policy by name; :data:`POLICIES` lists what is registered
(``lru``, ``lfu``, ``arc``, ``wfq``, ``threshold``, ``experts`` (follows whichever of lru, lfu, arc and threshold does best
on shadow caches of the same workload), ``belady`` (evaluation only: the
simulator feeds it the future), ``rl`` (the shipped trained policy); ``rl:PATH`` loads a
trained policy file).
Unknown names raise :class:`kvray.core.errors.PolicyError` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable

from kvray.core.errors import PolicyError
from kvray.policy.arc import ARCPolicy
from kvray.policy.base import PageContext, PlacementPolicy
from kvray.policy.belady import BeladyPolicy
from kvray.policy.experts import ExpertsPolicy
from kvray.policy.lfu import LFUPolicy
from kvray.policy.lru import LRUPolicy
from kvray.policy.threshold import ThresholdPolicy
from kvray.policy.wfq import WFQPolicy


def _rl(path: str | None = None) -> PlacementPolicy:
    from kvray.policy.rl import RLPolicy  # loads weights; kept out of plain imports

    return RLPolicy.load(path)


POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "arc": ARCPolicy,
    "wfq": WFQPolicy,
    "threshold": ThresholdPolicy,
    "belady": BeladyPolicy,
    "experts": ExpertsPolicy,
    "rl": _rl,
}


def register(name: str, factory: Callable[[], PlacementPolicy]) -> None:
    POLICIES[name] = factory


def make_policy(name: str) -> PlacementPolicy:
    """A policy by registered name; ``rl:PATH`` loads a trained policy from ``PATH``."""
    if name.startswith("rl:"):
        return _rl(name[3:])
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()


__all__ = [
    "ARCPolicy",
    "BeladyPolicy",
    "ExpertsPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "POLICIES",
    "PageContext",
    "PlacementPolicy",
    "ThresholdPolicy",
    "WFQPolicy",
    "make_policy",
    "register",
]
