"""The controller's partition function: a chain belongs to the shard of its routing page
(its root by default), every page past the routing depth to exactly one shard and every
page above it to all, each shard's share stays prefix-closed, and the split is even: by
root over many roots, and past the shared prompt under one hot root."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.errors import RequestError
from kvray.core.index import parents_first
from kvray.core.keys import ModelFingerprint, page_keys, trace_page_keys
from kvray.core.partition import Partition, chain_shard, owned_links, shard_of, short_prefix_shards
from kvray.traces import read_trace
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


@given(keys=st.lists(KEYS, min_size=1, max_size=20), shards=st.integers(1, 64), depth=st.integers(0, 25))
def test_a_deeper_route_is_the_page_at_that_depth_or_the_last(keys, shards, depth):
    assert chain_shard(keys, shards, depth) == shard_of(keys[min(depth, len(keys) - 1)], shards)
    assert chain_shard(keys, shards, 0) == chain_shard(keys, shards)


@given(keys=st.lists(KEYS, min_size=1, max_size=20), shards=st.integers(1, 8), depth=st.integers(0, 6))
def test_every_short_prefixs_lookup_shard_is_named_with_a_prefix_covering_it(keys, shards, depth):
    owners = short_prefix_shards(keys, shards, depth)
    for length in range(1, min(depth, len(keys)) + 1):  # a prefix with no page at depth routes by its last page
        shard = chain_shard(keys[:length], shards, depth)
        assert length <= owners[shard] <= min(depth, len(keys))  # committing the longer prefix there covers it
        assert chain_shard(keys[: owners[shard]], shards, depth) == shard
    assert set(owners) == {chain_shard(keys[:n], shards, depth) for n in range(1, min(depth, len(keys)) + 1)}


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32), chains=st.integers(1, 40), shards=st.integers(1, 8), depth=st.integers(0, 3))
def test_owned_links_split_every_forest_into_prefix_closed_shares(seed, chains, shards, depth):
    ordered, orphans = parents_first(forest(seed, chains))
    assert not orphans
    depth_of: dict[int, int] = {}
    for key, parent, _ in ordered:
        depth_of[key] = 0 if parent is None else depth_of[parent] + 1
    shares = [owned_links(ordered, Partition(s, shards, depth)) for s in range(shards)]
    deep = [link for link in ordered if depth_of[link[0]] >= depth]
    owned = sorted(link for share in shares for link in share if depth_of[link[0]] >= depth)
    assert owned == sorted(deep)  # each page past the depth exactly once
    for shard, share in enumerate(shares):
        keys = {key for key, _, _ in share}
        if shards > 1:  # every page above the routing depth is in every shard: any may route through it
            assert {link for link in ordered if depth_of[link[0]] < depth} <= set(share)
        for key, parent, _ in share:
            assert parent is None or parent in keys  # a shard's index can hold its share alone
            if depth_of[key] == depth:
                assert shard_of(key, shards) == shard
        assert [link for link in ordered if link in set(share)] == share  # still parents first


@pytest.mark.parametrize("shards", [2, 4])
def test_one_hot_roots_lookups_spread_when_routed_past_it(shards):
    """The bundled conversation trace has one root page (every request starts with the same
    prompt block): routed by the root, all its 5,719 lookups go to one shard; routed by the
    page after it, the busiest shard takes at most 1.3x an even share."""
    fingerprint = ModelFingerprint.of(TINY, "partition-test")
    requests = [trace_page_keys(fingerprint, r.hash_ids) for r in read_trace("conversation_trace_first30min.jsonl")]
    assert len({keys[0] for keys in requests}) == 1
    by_root = Counter(chain_shard(keys, shards) for keys in requests)
    past_root = Counter(chain_shard(keys, shards, depth=1) for keys in requests)
    even = len(requests) / shards
    assert len(by_root) == 1
    assert len(past_root) == shards and max(past_root.values()) <= 1.3 * even


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
