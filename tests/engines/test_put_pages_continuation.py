"""PageStore.put_pages(parent_key=...): engines store only the pages they computed, as the
continuation of a cached prefix, without breaking the index's prefix closure."""

from __future__ import annotations

import numpy as np

from kvray import PageLayout, PageStore, StoreConfig, TierSizes

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=4, dtype="float32")


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_nbytes), dtype=np.uint8)


def test_continuation_extends_the_cached_prefix_and_reads_back_exactly():
    store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=16)))
    keys = store.keys(list(range(24)))  # 6 pages
    head, tail = pages(2, 0), pages(4, 1)
    assert store.put_pages(keys[:2], head, store.fingerprint.digest) == 2
    assert store.put_pages(keys[2:], tail, store.fingerprint.digest, parent_key=keys[1]) == 4
    assert store.lookup(list(range(24))) == 24
    found, raw = store.get_pages(keys)
    assert found == keys and np.array_equal(raw, np.concatenate([head, tail]))


def test_continuation_of_a_prefix_no_longer_cached_stores_nothing():
    store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=16)))
    keys = store.keys(list(range(24)))
    assert store.put_pages(keys[2:], pages(4, 2), store.fingerprint.digest, parent_key=keys[1]) == 0
    assert len(store) == 0 and store.lookup(list(range(24))) == 0
