"""S3-FIFO and SIEVE behave as their published definitions say, inside the real CacheManager,
and keep their queues equal to the tiers' pages under random prefix workloads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from kvray.core.index import ROOT
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy, PlacementPolicy
from kvray.core.tiers import Tier
from kvray.policy import make_policy
from kvray.policy.s3fifo import S3FIFOPolicy
from kvray.policy.sieve import SievePolicy
from tests.policy.cache_ops import NO_MOVE, apply, operations
from tests.properties import examples


def store(manager: CacheManager, key: int) -> int:
    assert manager.store_chain([key], NO_MOVE) == 1
    return manager.index.handle_of(key)


def cached(manager: CacheManager) -> set[int]:
    return set(manager.index.keys())


# -- SIEVE -------------------------------------------------------------------------------
def sieve_after(hit_again: bool) -> set[int]:
    """Three pages; 1 is hit, the hand spares it once (clearing its bit); then every page
    after it is hit, so the hand wraps round to 1 again."""
    manager = CacheManager({Tier.HOST: 3}, SievePolicy())
    one, _, three = (store(manager, k) for k in (1, 2, 3))
    manager.touch(np.array([one]))
    store(manager, 4)  # the hand passes 1 (visited: it stays, unvisited now) and takes 2
    assert cached(manager) == {1, 3, 4}
    manager.touch(np.array([three, manager.index.handle_of(4)]))
    if hit_again:
        manager.touch(np.array([one]))
    store(manager, 5)  # the hand clears 3 and 4, wraps to the tail: 1
    return cached(manager)


def test_sieve_keeps_a_page_hit_since_the_hand_passed():
    assert sieve_after(hit_again=True) == {1, 4, 5}  # 1 stays; 3, cleared on the last pass, goes


def test_sieve_evicts_a_page_not_hit_since_the_hand_passed():
    assert sieve_after(hit_again=False) == {3, 4, 5}


def test_sieve_hits_reorder_nothing_and_new_pages_leave_first():
    """A page hit once stays while never-hit newcomers stream past it, where LRU (which
    moves a hit page to the front only once) lets the stream flush it."""

    def survives(policy: PlacementPolicy) -> bool:
        manager = CacheManager({Tier.HOST: 4}, policy)
        hot = store(manager, 1)
        manager.touch(np.array([hot]))
        for key in range(100, 120):
            store(manager, key)
        return 1 in manager.index

    assert survives(SievePolicy())
    assert not survives(LRUPolicy())


def test_sieve_passes_over_pinned_pages_and_answers_none_when_all_are():
    policy = SievePolicy()
    manager = CacheManager({Tier.HOST: 2}, policy)
    one, two = store(manager, 1), store(manager, 2)
    manager.pin(np.array([one]))
    assert policy.victim(Tier.HOST) == two
    manager.pin(np.array([two]))
    assert policy.victim(Tier.HOST) is None
    manager.unpin(np.array([one, two]))
    assert policy.victim(Tier.HOST) == two  # the hand stays where it stopped


# -- S3-FIFO -----------------------------------------------------------------------------
def hot_pages_then_a_scan(policy: PlacementPolicy) -> CacheManager:
    """Nine pages hit once, then a scan of 40 pages never hit, through a tier of ten."""
    manager = CacheManager({Tier.HOST: 10}, policy)
    hot = [store(manager, k) for k in range(1, 10)]
    manager.touch(np.array(hot))
    for key in range(100, 140):
        store(manager, key)
    return manager


def test_s3fifo_one_hit_wonders_leave_from_the_small_queue():
    policy = S3FIFOPolicy()
    manager = hot_pages_then_a_scan(policy)
    queues = policy._queues[Tier.HOST]
    assert cached(manager) == set(range(1, 10)) | {139}  # every scanned page but the last left
    assert {manager.index.key_of(h) for h in queues.main} == set(range(1, 10))  # hit in small: moved to main
    assert [manager.index.key_of(h) for h in queues.small] == [139]
    assert list(queues.ghost) == list(range(130, 139))  # the ghost holds as many keys as main
    assert cached(hot_pages_then_a_scan(LRUPolicy())) == set(range(130, 140))  # LRU: the scan flushed them


def test_s3fifo_admits_a_ghost_hit_straight_to_main():
    policy = S3FIFOPolicy()
    manager = hot_pages_then_a_scan(policy)
    queues = policy._queues[Tier.HOST]
    assert 138 in queues.ghost  # it left the small queue unhit
    assert store(manager, 138) in queues.main and 138 not in queues.ghost
    assert store(manager, 500) in queues.small


def test_s3fifo_main_reinserts_a_page_hit_since_it_was_last_passed():
    policy = S3FIFOPolicy()
    manager = hot_pages_then_a_scan(policy)
    queues = policy._queues[Tier.HOST]
    manager.pin(np.array(list(queues.small)))  # the small queue has nothing to give: main does
    first, second = list(queues.main)[:2]
    manager.touch(np.array([first]))
    assert policy.victim(Tier.HOST) == second
    assert list(queues.main)[-1] == first  # back at the head, its hit spent
    assert policy.victim(Tier.HOST) == second  # asking twice gives the same answer


# -- both, under random prefix workloads ---------------------------------------------------
def tracked(policy: PlacementPolicy, tier: Tier) -> list[int]:
    """The handles a policy keeps for ``tier``, each once per queue it is in."""
    if isinstance(policy, SievePolicy):
        queue = policy._queues[tier]
        walk, handle = [], queue.tail
        while handle is not None:  # the list from the tail reaches every page once, ending at the head
            walk.append(handle)
            handle = queue.newer[handle]
        assert (walk[-1] if walk else None) == queue.head and len(walk) == len(queue)
        assert queue.visited <= set(walk) and (queue.hand is None or queue.hand in walk)
        return walk
    queues = policy._queues[tier]
    return list(queues.small) + list(queues.main)


@pytest.mark.parametrize("name", ["s3fifo", "sieve"])
@settings(max_examples=examples(60), deadline=None)
@given(ops=operations)
def test_queues_follow_the_tiers_and_every_victim_can_be_asked_to_leave(name, ops):
    """Chains stored through tight tiers (demotions, drops of subtrees, refusals under pins):
    each tier's queue holds exactly its pages, a victim is an unpinned page of the tier
    (None only when every page is pinned), the index stays prefix-closed."""
    policy = make_policy(name)
    manager = CacheManager({Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 4}, policy)
    index, pinned = manager.index, []
    for op, path in ops:
        apply(manager, op, path, pinned)
        handles = [index.handle_of(k) for k in index.keys()]
        for tier in manager.tiers:
            mine = [h for h in handles if index.tier[h] == tier]
            queue = tracked(policy, tier)
            assert sorted(queue) == sorted(mine) and manager.slots[tier].used == len(mine)
            victim = policy.victim(tier)
            unpinned = {h for h in mine if index.pins[h] == 0}
            assert victim in unpinned if unpinned else victim is None
        assert all(index.parent[h] == ROOT or index.key_of(int(index.parent[h])) is not None for h in handles)
