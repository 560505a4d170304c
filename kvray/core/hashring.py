"""Consistent hashing of page keys onto nodes.

When a request's prefix is larger than one node keeps, its pages are spread over the
cluster's host tiers by a hash ring: each node owns many virtual points on a 64-bit ring
and a page goes to the first point at or after its key. Adding or losing a node moves only
the pages that node owns (about 1/N of them), so the rest of the index stays valid.

Example::

    from kvray.core.hashring import HashRing

    ring = HashRing(["node-a", "node-b", "node-c"])
    before = ring.owners([11, 22, 33])                       # e.g. ["node-b", "node-a", "node-b"]
    ring.remove("node-b")                                    # only node-b's keys move
    assert all(b == a for b, a in zip(before, ring.owners([11, 22, 33])) if b != "node-b")
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from kvray.core.keys import MASK64


def low64(keys: Sequence[int]) -> np.ndarray:
    """The low 64 bits of 128-bit page keys (already uniform: keys are xxh3 digests)."""
    return np.fromiter((k & MASK64 for k in keys), dtype=np.uint64, count=len(keys))


class HashRing:
    """A ring of ``vnodes`` virtual points per node; ``owners`` maps keys to nodes vectorised."""

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._nodes: list[str] = []
        self._points = np.empty(0, dtype=np.uint64)
        self._owner = np.empty(0, dtype=np.int64)
        for node in nodes:
            self.add(node)

    def add(self, node: str) -> None:
        if node in self._nodes:
            return
        self._nodes.append(node)
        self._rebuild()

    def remove(self, node: str) -> None:
        if node in self._nodes:
            self._nodes.remove(node)
            self._rebuild()

    def _rebuild(self) -> None:
        points = [
            (xxhash.xxh3_64_intdigest(f"{node}#{i}".encode()), n)
            for n, node in enumerate(self._nodes)
            for i in range(self.vnodes)
        ]
        points.sort()
        self._points = np.array([p for p, _ in points], dtype=np.uint64)
        self._owner = np.array([n for _, n in points], dtype=np.int64)

    def owners(self, keys: Sequence[int]) -> list[str]:
        """The node owning each key (the first ring point clockwise of the key)."""
        if not self._nodes:
            raise LookupError("the hash ring has no nodes")
        at = np.searchsorted(self._points, low64(keys), side="left") % len(self._points)
        return [self._nodes[i] for i in self._owner[at].tolist()]
