"""LeCaR learns which of recency and frequency to trust: the expert whose evictions come back
loses weight, draws are seeded, and the policy's lists follow the tier's pages exactly."""

from kvray.core.manager import CacheManager
from kvray.core.tiers import Tier
from kvray.policy.lecar import LFU, LRU, LeCaRPolicy


def noop(*move):
    return None


def scan_with_a_hot_page(seed: int) -> tuple[LeCaRPolicy, CacheManager, list[int]]:
    """A hot page asked for (and hit) between bursts of four one-off pages: recency evicts
    it from a tier of four, frequency keeps it."""
    policy = LeCaRPolicy(seed=seed)
    manager = CacheManager({Tier.HOST: 4}, policy)
    hot_misses = []
    for step in range(400):
        if not len(manager.lookup([1])):
            hot_misses.append(step)
            manager.store_chain([1], noop)
        manager.touch(manager.lookup([1]).handles)  # asked for: a hit
        for one_off in range(4):
            manager.store_chain([1000 + 4 * step + one_off], noop)
    return policy, manager, hot_misses


def test_the_expert_whose_evictions_return_loses_weight():
    policy, manager, hot_misses = scan_with_a_hot_page(seed=0)
    weights = policy._experts[Tier.HOST].weights
    assert weights[LFU] > 0.8 > 0.2 > weights[LRU]
    assert len(hot_misses) < 100  # of 400 asks: once frequency leads, the hot page stays
    members = set(policy._experts[Tier.HOST].recency)
    assert members == {manager.index.handle_of(k) for k in manager.index.keys()}


def test_draws_are_seeded():
    assert scan_with_a_hot_page(seed=3)[2] == scan_with_a_hot_page(seed=3)[2]
