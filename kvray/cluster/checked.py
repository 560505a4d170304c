"""Checked requests: page bytes that follow from the page key, so every loaded page is verified.

Workloads that stand in for an engine (the replay engine, the soak, the concurrency
benchmark, the reliability tests) compute a page's "KV" as a fixed random pattern XOR
its key (:class:`PagePattern`). A page key carries its whole prefix, so a page that came
back for the wrong key, torn, or overwritten by a late copy does not match: it is counted,
never silently used. :func:`serve_checked` is such an engine's request, end to end.

Example::

    pattern = PagePattern(client.page_nbytes)
    served = serve_checked(client, pattern, client.keys_for_trace([1, 2, 3]))
    served.hit, served.wrong, served.stored          # (0, 0, 3) on a cold cache
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvray.cluster.client import KvrayClient
from kvray.cluster.protocol import Loaded
from kvray.core.keys import MASK64


class PagePattern:
    """The KV bytes a page must hold: one random page XOR the key's low 64 bits.

    Example::

        pattern = PagePattern(page_nbytes=4096)
        pattern.fill(key, row); pattern.matches(key, row)    # True
    """

    def __init__(self, page_nbytes: int, seed: int = 0) -> None:
        self.base = np.random.default_rng(seed).integers(0, 2**63, page_nbytes // 8, dtype=np.uint64)
        self._scratch = np.empty_like(self.base)

    def fill(self, key: int, row: np.ndarray) -> None:
        np.bitwise_xor(self.base, np.uint64(key & MASK64), out=row.view(np.uint64))

    def matches(self, key: int, row: np.ndarray) -> bool:
        np.bitwise_xor(row.view(np.uint64), self.base, out=self._scratch)
        return bool((self._scratch == np.uint64(key & MASK64)).all())

    def fill_rows(self, keys: Sequence[int], rows: np.ndarray) -> None:
        """Compute the pages of ``keys`` into ``rows`` (one row per key, in order)."""
        for key, row in zip(keys, rows):
            self.fill(key, row)

    def wrong(self, keys: Sequence[int], rows: np.ndarray) -> int:
        """How many of ``rows`` (one per key of ``keys``) do not hold their key's bytes."""
        return sum(not self.matches(key, row) for key, row in zip(keys, rows))


@dataclass(frozen=True)
class Served:
    """What one checked request got: pages hit, hit pages with wrong bytes, pages stored."""

    hit: int
    wrong: int
    stored: int
    loaded: Loaded  # the load's record: by tier, by path, bytes between nodes


def serve_checked(client: KvrayClient, pattern: PagePattern, keys: Sequence[int]) -> Served:
    """One engine request: load the cached prefix, check every loaded page, compute the
    rest by ``pattern`` and store it."""
    with client.request(keys) as r:
        wrong = pattern.wrong(keys[: r.hit], r.rows)
        pattern.fill_rows(keys[r.hit :], r.rows[r.hit :])
        r.store()
    return Served(r.hit, wrong, r.stored, r.loaded)
