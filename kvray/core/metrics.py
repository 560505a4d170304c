"""Counters every cache manager keeps: hits per tier, misses, bytes moved, swap latency.

Bytes are counted where they cross: ``bytes_moved`` between a node's tiers, ``bytes_loaded``
out of the tiers to readers (the bytes behind the hits, including those an engine copied out
of a shared host tier itself and reported), ``bytes_stored`` into them from writers.

The same :class:`CacheMetrics` is filled by the runtime (measured times) and by the
simulator (modeled times), so their reports compare field by field. ``snapshot()`` gives a
plain dict (what ``--json`` prints and what the Ray runtime exports to Prometheus).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cache

import numpy as np

# Swap-latency histogram buckets: 1 us .. ~17 s, doubling.
LATENCY_BUCKETS_S: tuple[float, ...] = tuple(1e-6 * 2**i for i in range(25))


@dataclass
class LatencyHistogram:
    """Log-bucketed latency histogram (seconds) with exact count, sum and max."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0
    max: float = 0.0

    def observe(self, seconds: float) -> None:
        i = 0 if seconds <= 0 else min(max(math.ceil(math.log2(seconds / 1e-6)), 0), len(LATENCY_BUCKETS_S))
        self.counts[i] += 1
        self.total += seconds
        self.n += 1
        self.max = max(self.max, seconds)

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0 when empty)."""
        if self.n == 0:
            return 0.0
        rank = q * self.n
        cumulative = np.cumsum(self.counts)
        i = int(np.searchsorted(cumulative, rank))
        return min(LATENCY_BUCKETS_S[i] if i < len(LATENCY_BUCKETS_S) else self.max, self.max)

    def summary(self) -> dict[str, float]:
        return {
            "count": self.n,
            "mean_s": self.total / self.n if self.n else 0.0,
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
            "max_s": self.max,
        }


@cache
def _move_name(src: str, dst: str) -> str:
    """The ``moved_pages`` key of a move, formatted once per pair (a move is counted per page)."""
    return f"{src}->{dst}"


@dataclass
class CacheMetrics:
    """Hit, miss, movement and integrity counters of one cache."""

    page_nbytes: int = 0
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages: Counter = field(default_factory=Counter)  # tier label -> pages hit
    stored_pages: int = 0
    loaded_pages: int = 0  # pages copied out to readers (by the store, or by a reader that reported it)
    stored_by_tier: Counter = field(default_factory=Counter)  # tier label -> pages stored there
    evicted_pages: int = 0
    moved_pages: Counter = field(default_factory=Counter)  # "src->dst" -> pages
    corrupt_pages: int = 0
    swap_latency: dict[str, LatencyHistogram] = field(default_factory=dict)  # op -> histogram

    @property
    def miss_pages(self) -> int:
        return self.lookup_pages - sum(self.hit_pages.values())

    @property
    def bytes_moved(self) -> int:
        return sum(self.moved_pages.values()) * self.page_nbytes

    def count_move(self, src: str, dst: str, pages: int = 1) -> None:
        self.moved_pages[_move_name(src, dst)] += pages

    def written_pages(self, tier: str) -> int:
        """Pages that went into ``tier`` (its label): stored there, or moved there from another tier."""
        into = f"->{tier}"
        return self.stored_by_tier[tier] + sum(pages for move, pages in self.moved_pages.items() if move.endswith(into))

    def observe(self, op: str, seconds: float) -> None:
        self.swap_latency.setdefault(op, LatencyHistogram()).observe(seconds)

    def snapshot(self) -> dict:
        hits = sum(self.hit_pages.values())
        return {
            "lookups": self.lookups,
            "lookup_pages": self.lookup_pages,
            "hit_pages": hits,
            "miss_pages": self.miss_pages,
            "page_hit_rate": hits / self.lookup_pages if self.lookup_pages else 0.0,
            "hit_pages_by_tier": dict(self.hit_pages),
            "stored_pages": self.stored_pages,
            "evicted_pages": self.evicted_pages,
            "moved_pages": dict(self.moved_pages),
            "bytes_moved": self.bytes_moved,
            "bytes_loaded": self.loaded_pages * self.page_nbytes,
            "bytes_stored": self.stored_pages * self.page_nbytes,
            "corrupt_pages": self.corrupt_pages,
            "swap_latency": {op: h.summary() for op, h in self.swap_latency.items()},
        }
