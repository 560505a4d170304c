"""Placement policies and their registry.

``make_policy("lru")`` builds a policy by name; :data:`POLICIES` lists what is registered.
Unknown names raise :class:`kvray.errors.PolicyError` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable

from kvray.errors import PolicyError
from kvray.policy.base import PageContext, PlacementPolicy
from kvray.policy.lru import LRUPolicy

POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "lru": LRUPolicy,
}


def register(name: str, factory: Callable[[], PlacementPolicy]) -> None:
    POLICIES[name] = factory


def make_policy(name: str) -> PlacementPolicy:
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()


__all__ = ["POLICIES", "PageContext", "PlacementPolicy", "LRUPolicy", "make_policy", "register"]
