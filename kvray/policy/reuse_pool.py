"""The reuse policy's candidate pool: :func:`gather`, in C where built (``kvray.policy._pool.pool``
and ``scored``, kvray/policy/_pool.c), and :func:`gather_python` in numpy, the reference that
the C transcribes and tests/policy/test_reuse_pool.py compares it with on random columns full
of ties.

Of the unpinned pages of a tier, the ``lru`` of lowest recency, the ``lfu`` of lowest
frequency key and the ``fifo`` never read of lowest recency (:data:`kvray.policy.reuse.POOL`),
each ordering's picks by (key, handle) ascending, concatenated in that order and deduplicated
(a page's first offer wins), with which orderings offered each page. ``ReusePolicy`` takes
both as its own (``_gather``, ``gather_python``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.tiers import Tier
from kvray.policy.page_features import PageFeatures

try:  # the gathering in C (kvray/policy/_pool.c); without it gather_python
    from kvray.policy import _pool
except ImportError:  # pragma: no cover - a checkout whose extensions were not built
    _pool = None


class PoolOwner(Protocol):
    """What the gathering reads: the pool's sizes and the owner's columns by handle (the
    orderings' keys, and two scratch columns it writes)."""

    pool: tuple[int, int, int]
    index: PrefixIndex
    features: PageFeatures
    _where: np.ndarray
    _recency: np.ndarray
    _frequency: np.ndarray
    _bits: np.ndarray
    _first_at: np.ndarray


def gather(policy: PoolOwner, tier: Tier) -> tuple[np.ndarray, np.ndarray]:
    """The pool of ``tier``: its candidates in the order offered, deduplicated, and which
    orderings offered each (no columns when LRU alone offers). In C where built (one pass
    over the tier's pages), else :func:`gather_python`, the reference it transcribes."""
    lru, lfu, fifo = policy.pool
    if _pool is None:
        return gather_python(policy, tier)
    columns = (policy._where, policy.index.pins, policy._recency, policy._frequency, policy.features.hits)
    handles, bits = _pool.pool(int(tier), lru, lfu, fifo, *columns)
    candidates = np.frombuffer(handles, dtype=np.int64)
    if not (lfu or fifo):
        return candidates, np.zeros((0, 3), dtype=np.float32)
    return candidates, ((np.frombuffer(bits, dtype=np.uint8)[:, None] >> np.arange(3)) & 1).astype(np.float32)


def gather_python(policy: PoolOwner, tier: Tier) -> tuple[np.ndarray, np.ndarray]:
    """``ReusePolicy._gather`` in numpy: a mask of the tier's unpinned pages, one partial sort per ordering."""
    lru, lfu, fifo = policy.pool
    pins = policy.index.pins
    n = min(len(policy._where), len(pins))
    pages = np.flatnonzero((policy._where[:n] == tier) & (pins[:n] == 0))  # unpinned, ascending handles
    candidates = first(pages, policy._recency[pages], lru)
    source = np.zeros((0, 3), dtype=np.float32)
    if lfu or fifo:
        unread = pages[policy.features.hits[pages] == 0]
        offered = (
            candidates,
            first(pages, policy._frequency[pages], lfu),
            first(unread, policy._recency[unread], fifo),
        )
        every = np.concatenate(offered)
        bits, first_at = policy._bits, policy._first_at  # scratch columns by handle
        bits[every] = 0
        for ordering, picked in enumerate(offered):  # an ordering offers a page once
            bits[picked] |= 1 << ordering
        first_at[every[::-1]] = np.arange(len(every) - 1, -1, -1)  # each page's first offer wins
        candidates = every[first_at[every] == np.arange(len(every))]  # deduplicated, in the order offered
        source = ((bits[candidates][:, None] >> np.arange(3)) & 1).astype(np.float32)
    return candidates, source


def first(pages: np.ndarray, order: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` pages of lowest ``order`` (ties: lowest handle first; ``pages`` ascend), in that order."""
    if n == 0 or len(pages) == 0:
        return pages[:0]
    if len(pages) > n:
        kth = np.partition(order, n - 1)[n - 1]
        keep = np.flatnonzero(order <= kth)
        pages, order = pages[keep], order[keep]
    return pages[np.argsort(order, kind="stable")[:n]]
