"""The controller's partition function: a chain belongs whole to its root's shard, every
page to exactly one shard, each shard's share stays prefix-closed, and the split is even."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.errors import RequestError
from kvray.core.index import parents_first
from kvray.core.keys import ModelFingerprint, page_keys
from kvray.core.partition import Partition, chain_shard, owned_links, shard_of
from tests.conftest import TINY
from tests.properties import examples

KEYS = st.integers(min_value=0, max_value=2**128 - 1)


@given(keys=st.lists(KEYS, min_size=1, max_size=20), shards=st.integers(1, 64))
def test_a_chain_belongs_to_its_roots_shard(keys, shards):
    shard = chain_shard(keys, shards)
    assert 0 <= shard < shards
    assert shard == shard_of(keys[0], shards) == chain_shard(keys[:1], shards)
    assert Partition(shard, shards).owns(keys[0])
    assert sum(Partition(s, shards).owns(keys[0]) for s in range(shards)) == 1


def forest(seed: int, chains: int) -> list[tuple[int, int | None, str]]:
    """Links of ``chains`` chains sharing prefixes (a page may have several children), shuffled."""
    rng = random.Random(seed)
    links, made = [], []
    for _ in range(chains):
        parent = rng.choice(made) if made and rng.random() < 0.6 else None
        for _ in range(rng.randint(1, 5)):
            key = rng.getrandbits(128)
            links.append((key, parent, f"node-{rng.randrange(4)}"))
            made.append(key)
            parent = key
    rng.shuffle(links)
    return links


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32), chains=st.integers(1, 40), shards=st.integers(1, 8))
def test_owned_links_split_every_forest_into_prefix_closed_shares(seed, chains, shards):
    ordered, orphans = parents_first(forest(seed, chains))
    assert not orphans
    shares = [owned_links(ordered, Partition(s, shards)) for s in range(shards)]
    assert sorted(link for share in shares for link in share) == sorted(ordered)  # each page exactly once
    for shard, share in enumerate(shares):
        keys = {key for key, _, _ in share}
        for key, parent, _ in share:
            assert parent is None or parent in keys  # a shard's index can hold its share alone
            if parent is None:
                assert shard_of(key, shards) == shard
        assert [link for link in ordered if link in set(share)] == share  # still parents first


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_real_page_keys_and_small_ints_split_evenly(shards):
    """Roots of real key chains (xxh3-128) and made-up small ints: every shard within 10% of
    an even share of 20,000 roots (binomial noise at this size is ~2%)."""
    fingerprint = ModelFingerprint.of(TINY, "partition-test")
    real = [page_keys([i, i + 1, i + 2, i + 3], fingerprint)[0] for i in range(20_000)]
    for roots in (real, list(range(20_000))):
        counts = Counter(shard_of(root, shards) for root in roots)
        even = len(roots) / shards
        assert len(counts) == shards and max(abs(n - even) for n in counts.values()) < 0.1 * even


def test_an_empty_chain_is_refused_by_name():
    with pytest.raises(RequestError, match="empty request"):
        chain_shard([], 2)
