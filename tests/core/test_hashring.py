"""Consistent hashing of page keys onto nodes: balance and minimal movement."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.hashring import HashRing
from tests.properties import examples

KEYS = [(k * 0x9E3779B97F4A7C15 + 12345) % 2**128 for k in range(20_000)]


def test_keys_spread_over_all_nodes_about_evenly():
    ring = HashRing(["a", "b", "c"])
    counts = Counter(ring.owners(KEYS))
    assert set(counts) == {"a", "b", "c"}
    assert max(counts.values()) / min(counts.values()) < 1.6


def test_removing_a_node_moves_only_its_keys():
    ring = HashRing(["a", "b", "c", "d"])
    before = ring.owners(KEYS)
    ring.remove("c")
    after = ring.owners(KEYS)
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert moved and all(b == "c" for b, _ in moved)
    assert "c" not in after


@settings(max_examples=examples(30), deadline=None)
@given(
    st.lists(st.integers(0, 2**128 - 1), min_size=1, max_size=50),
    st.sets(st.text("xyz", min_size=1, max_size=3), min_size=1, max_size=5),
)
def test_owner_is_deterministic_and_a_member(keys, nodes):
    a, b = HashRing(sorted(nodes)), HashRing(sorted(nodes, reverse=True))
    assert a.owners(keys) == b.owners(keys)
    assert set(a.owners(keys)) <= nodes


def test_empty_ring_says_so():
    with pytest.raises(LookupError):
        HashRing().owners([1])
