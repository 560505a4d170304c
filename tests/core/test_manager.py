"""The cache manager's verbs, one at a time, and a property test of their invariants.

The manager holds no bytes: a ``mover`` stands in for the data plane and records what it
was asked to copy, so each test can check both the index and the moves it caused.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.errors import StorageError
from kvray.core.index import ROOT
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy
from kvray.core.tiers import Tier
from kvray.policy.lfu import LFUPolicy
from tests.properties import examples


class Mover:
    """Records moves; raises for the handles it is told to fail."""

    def __init__(self) -> None:
        self.moves: list[tuple[int, Tier, Tier]] = []
        self.failing: set[int] = set()

    def __call__(self, handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> int | None:
        if handle in self.failing:
            raise StorageError("copy failed")
        self.moves.append((handle, src, dst))
        return None


def store_chain(manager: CacheManager, keys: list[int], mover: Mover, tier: Tier = Tier.HOST) -> list[int]:
    handles, parent = [], ROOT
    for key in keys:
        slot = manager.reserve(tier, mover)
        assert slot is not None
        parent = manager.complete_store(key=key, tier=tier, slot=slot, checksum=key, parent=parent)
        handles.append(parent)
    return handles


def tier_of(manager: CacheManager, key: int) -> Tier | None:
    handle = manager.index.handle_of(key)
    return None if handle is None else Tier(int(manager.index.tier[handle]))


def test_lookup_reports_the_cached_prefix_and_counts_hits_by_tier():
    manager, mover = CacheManager({Tier.HOST: 4}, LRUPolicy()), Mover()
    store_chain(manager, [1, 2, 3], mover)
    match = manager.lookup([1, 2, 9, 3])
    assert len(match) == 2 and match.tiers.tolist() == [Tier.HOST, Tier.HOST]
    assert match.checksums.tolist() == [1, 2]
    assert manager.metrics.lookups == 1 and manager.metrics.hit_pages["host"] == 2
    manager.lookup([1], count=False)
    assert manager.metrics.lookups == 1


def test_reserve_evicts_the_policys_victim_by_demoting_it():
    manager, mover = CacheManager({Tier.HOST: 2, Tier.DISK: 4}, LRUPolicy()), Mover()
    a, b = store_chain(manager, [1, 2], mover)
    store_chain(manager, [10], mover)  # host full: the least recent (page 1) goes to disk
    assert mover.moves == [(a, Tier.HOST, Tier.DISK)]
    assert tier_of(manager, 1) == Tier.DISK and tier_of(manager, 2) == Tier.HOST
    assert manager.slots[Tier.HOST].used == 2 and manager.slots[Tier.DISK].used == 1


def test_touch_changes_what_lru_evicts():
    manager, mover = CacheManager({Tier.HOST: 2}, LRUPolicy()), Mover()
    store_chain(manager, [1], mover)
    store_chain(manager, [2], mover)
    manager.touch(manager.lookup([1]).handles)
    store_chain(manager, [3], mover)  # no lower tier: the victim is dropped
    assert 1 in manager.index and 2 not in manager.index and 3 in manager.index


def test_pinned_pages_are_never_evicted_and_reserve_gives_up():
    manager, mover = CacheManager({Tier.HOST: 2}, LRUPolicy()), Mover()
    handles = store_chain(manager, [1, 2], mover)
    manager.pin(np.array(handles))
    assert manager.reserve(Tier.HOST, mover) is None
    assert len(manager.index) == 2
    manager.unpin(np.array(handles))
    assert manager.reserve(Tier.HOST, mover) is not None


def test_kept_pages_may_be_demoted_but_not_dropped():
    manager, mover = CacheManager({Tier.HOST: 1, Tier.DISK: 1}, LRUPolicy()), Mover()
    (a,) = store_chain(manager, [1], mover)
    manager.keep(a)
    assert manager.drop(a) == 0 and 1 in manager.index
    assert manager.relocate(a, Tier.DISK, mover) and tier_of(manager, 1) == Tier.DISK
    manager.release(a)
    assert manager.drop(a) == 1 and 1 not in manager.index


def test_relocate_that_fails_leaves_the_page_where_it_was():
    manager, mover = CacheManager({Tier.HOST: 1, Tier.DISK: 1}, LRUPolicy()), Mover()
    (a,) = store_chain(manager, [1], mover)
    mover.failing.add(a)
    assert not manager.relocate(a, Tier.DISK, mover)
    assert tier_of(manager, 1) == Tier.HOST
    assert manager.slots[Tier.DISK].used == 0 and manager.slots[Tier.HOST].used == 1


def test_abort_store_gives_the_slot_back():
    manager, mover = CacheManager({Tier.HOST: 1}, LRUPolicy()), Mover()
    slot = manager.reserve(Tier.HOST, mover)
    assert manager.slots[Tier.HOST].used == 1
    manager.abort_store(Tier.HOST, slot)
    assert manager.slots[Tier.HOST].used == 0 and len(manager.index) == 0


def test_drop_takes_the_descendants_and_refuses_while_one_is_pinned():
    manager, mover = CacheManager({Tier.HOST: 8}, LRUPolicy()), Mover()
    a, b, c = store_chain(manager, [1, 2, 3], mover)
    dropped = []
    manager.page_dropped = dropped.append
    manager.pin(np.array([c]))
    assert manager.drop(b) == 0 and len(manager.index) == 3
    manager.unpin(np.array([c]))
    assert manager.drop(b) == 2 and sorted(dropped) == [2, 3]
    assert manager.lookup([1, 2, 3]).handles.tolist() == [a]
    assert manager.slots[Tier.HOST].used == 1


def test_promote_moves_hits_up_where_the_policy_asks():
    class Promoting(LRUPolicy):
        def promote_target(self, handle, tier):
            return Tier.HOST

    manager, mover = CacheManager({Tier.HOST: 2, Tier.DISK: 2}, Promoting()), Mover()
    slot = manager.reserve(Tier.DISK, mover)
    handle = manager.complete_store(key=1, tier=Tier.DISK, slot=slot, checksum=1, parent=ROOT)
    manager.promote(np.array([handle]), mover)
    assert tier_of(manager, 1) == Tier.HOST and mover.moves == [(handle, Tier.DISK, Tier.HOST)]


def test_a_hit_dropped_while_an_earlier_hit_moves_up_is_skipped():
    """Promoting one disk hit demotes host's victim into a full disk, whose victim may be a
    later page of the same hits: that page is gone, and nothing must move or remember it."""
    from kvray.policy.promote import promoting

    manager, mover = CacheManager({Tier.HOST: 1, Tier.DISK: 2}, promoting(LRUPolicy)()), Mover()
    for key in (1, 2, 3):  # 1 and 2 end on disk (1 the older), 3 in host
        manager.store_chain([key], mover)
    one, two = manager.index.handle_of(1), manager.index.handle_of(2)
    manager.promote(np.array([two, one]), mover)  # 2 up, 3 down, 1 (disk's LRU victim) dropped
    assert sorted(manager.index.keys()) == [2, 3] and tier_of(manager, 2) == Tier.HOST and tier_of(manager, 3) == Tier.DISK
    assert manager.slots[Tier.HOST].used == 1 and manager.slots[Tier.DISK].used == 1


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(st.integers(0, 6), min_size=1, max_size=5)),
        st.tuples(st.just("touch"), st.integers(0, 6)),
        st.tuples(st.just("drop"), st.integers(0, 6)),
    ),
    max_size=40,
)


@settings(max_examples=examples(150), deadline=None)
@given(OPS)
def test_any_sequence_of_verbs_keeps_slots_and_the_prefix_closed_index_consistent(ops):
    manager, mover = CacheManager({Tier.HOST: 3, Tier.DISK: 4}, LRUPolicy()), Mover()
    for op, arg in ops:
        if op == "store":
            keys = [hash(tuple(arg[: i + 1])) & 0xFFFF_FFFF for i in range(len(arg))]  # chained like page keys
            parent = ROOT
            for i, key in enumerate(keys):
                handle = manager.index.handle_of(key)
                if handle is None:
                    if parent != ROOT:
                        manager.keep(parent)  # making room must not drop the page the chain builds on
                    try:
                        slot = manager.reserve(Tier.HOST, mover)
                    finally:
                        if parent != ROOT:
                            manager.release(parent)
                    if slot is None:
                        break
                    handle = manager.complete_store(key=key, tier=Tier.HOST, slot=slot, checksum=i, parent=parent)
                parent = handle
        elif op == "touch":
            handles = [
                h for h in (manager.index.handle_of(k) for k in list(manager.index.keys())[arg : arg + 1]) if h is not None
            ]
            manager.touch(np.array(handles, dtype=np.int64))
        else:
            keys = list(manager.index.keys())
            if keys:
                manager.drop(manager.index.handle_of(keys[arg % len(keys)]))
        index = manager.index
        for tier, allocator in manager.slots.items():
            in_tier = [k for k in index.keys() if Tier(int(index.tier[index.handle_of(k)])) == tier]
            assert allocator.used == len(in_tier)
            assert len({int(index.slot[index.handle_of(k)]) for k in in_tier}) == len(in_tier)
        for key in index.keys():
            parent = int(index.parent[index.handle_of(key)])
            assert parent == ROOT or index.key_of(parent) in index  # prefix-closed


def test_capacities_of_zero_are_absent_tiers():
    manager = CacheManager({Tier.DEVICE: 0, Tier.HOST: 2}, LRUPolicy())
    assert manager.tiers == [Tier.HOST]
    with pytest.raises(KeyError):
        manager.reserve(Tier.DEVICE, Mover())


def test_a_pinned_leaf_refuses_drop_and_goes_once_unpinned():
    """A single leaf (an eviction's victim) is checked without numpy's vector path: pinned it
    stays, with its slot; unpinned it goes, given as a numpy integer too."""
    manager, mover = CacheManager({Tier.HOST: 8}, LRUPolicy()), Mover()
    a, b = store_chain(manager, [1, 2], mover)
    assert manager.index.is_leaf(b) and not manager.index.is_leaf(a)
    manager.pin(np.array([b]))
    assert manager.drop(b) == 0 and 2 in manager.index and manager.slots[Tier.HOST].used == 2
    manager.unpin(np.array([b]))
    assert manager.drop(np.int64(b)) == 1 and 2 not in manager.index and manager.slots[Tier.HOST].used == 1
    assert manager.index.is_leaf(a)


class _CountingLFU(LFUPolicy):
    """LFU that counts how often the manager asks it for a victim."""

    asked = 0

    def victim(self, tier: Tier) -> int | None:
        self.asked += 1
        return super().victim(tier)


class _OneByOne(CacheManager):
    """The manager as it refused before: one victim at a time, the policy asked for each."""

    def _held_with(self, victim: int, tier: Tier, target: Tier | None) -> list[int] | None:
        return None


@pytest.mark.parametrize("host, disk, chain", [(1, 60, 60), (4, 60, 80), (8, 100, 150)])
def test_the_chain_being_stored_is_refused_together_not_victim_by_victim(host, disk, chain):
    """LFU offers a new chain's own unhit pages first (root first, the least recent): none of
    them can go from the last tier (each is an ancestor of the page the chain is being
    stored under), and each refusal in the host tier first runs the disk's reserve to its
    limit. Refusing the tier's pages of the chain together leaves the same pages cached as
    refusing them one by one, asking the policy a fraction as often."""

    def store(manager_class: type[CacheManager]) -> tuple[set[int], int]:
        policy = _CountingLFU()
        manager = manager_class({Tier.HOST: host, Tier.DISK: disk}, policy)
        others = range(1000, 1000 + disk // 3)
        for key in others:
            manager.store_chain([key], Mover())
        manager.touch(np.array([manager.index.handle_of(key) for key in others]))  # hit once: LFU's last choice
        policy.asked = 0
        stored = manager.store_chain(list(range(1, chain + 1)), Mover())
        assert 0 < stored < chain  # the limit stopped the chain, as it guards admission
        return set(manager.index.keys()), policy.asked

    together, asked = store(CacheManager)
    one_by_one, asked_one_by_one = store(_OneByOne)
    assert together == one_by_one
    assert asked_one_by_one > 1.5 * asked
