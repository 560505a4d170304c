"""Prefix index: which pages exist, where each lives, who is reading it.

Because page keys chain over the whole prefix (:mod:`kvray.keys`), the longest cached
prefix of a request is the longest run of its keys present in one hash map: no tree walk
is needed, and the run is found at C speed with ``itertools.takewhile``. Entries are kept
column-wise (numpy arrays indexed by a small integer *handle*) so that an index of
millions of pages costs about a hundred bytes per page and so that a whole request's
tiers, slots and pins are read or updated in one vectorised step.

Pins protect pages being read or moved: a pinned page is never evicted or moved. Every
``pin`` is matched by an ``unpin``; the counts are per page, so concurrent readers stack.

Example::

    index = PrefixIndex()
    h = index.add(key=42, tier=Tier.HOST, slot=3, checksum=0xABC)
    index.match([42, 43])        # -> 1: only the first key is cached
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from itertools import takewhile

import numpy as np

_COLUMNS: dict[str, np.dtype] = {
    "tier": np.dtype(np.int8),
    "slot": np.dtype(np.int64),
    "node": np.dtype(np.int32),
    "checksum": np.dtype(np.uint64),
    "pins": np.dtype(np.int32),
    "hits": np.dtype(np.int64),
    "last_access": np.dtype(np.int64),
    "depth": np.dtype(np.int32),
}


class PrefixIndex:
    """Key -> handle map plus per-handle columns (tier, slot, node, checksum, pins, heat)."""

    def __init__(self, initial_capacity: int = 1024) -> None:
        self._handles: dict[int, int] = {}
        self._keys: list[int | None] = []
        self._free_handles: list[int] = []
        self._cols = {name: np.zeros(initial_capacity, dtype=dt) for name, dt in _COLUMNS.items()}
        self.clock = 0

    def __len__(self) -> int:
        return len(self._handles)

    def __contains__(self, key: int) -> bool:
        return key in self._handles

    # -- columns -----------------------------------------------------------------------
    @property
    def tier(self) -> np.ndarray:
        return self._cols["tier"]

    @property
    def slot(self) -> np.ndarray:
        return self._cols["slot"]

    @property
    def node(self) -> np.ndarray:
        return self._cols["node"]

    @property
    def checksum(self) -> np.ndarray:
        return self._cols["checksum"]

    @property
    def pins(self) -> np.ndarray:
        return self._cols["pins"]

    @property
    def hits(self) -> np.ndarray:
        return self._cols["hits"]

    @property
    def last_access(self) -> np.ndarray:
        return self._cols["last_access"]

    @property
    def depth(self) -> np.ndarray:
        return self._cols["depth"]

    def key_of(self, handle: int) -> int:
        key = self._keys[handle]
        if key is None:
            raise KeyError(f"handle {handle} is not in the index")
        return key

    def handle_of(self, key: int) -> int | None:
        return self._handles.get(key)

    def keys(self) -> Iterable[int]:
        return self._handles.keys()

    # -- queries -----------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> int:
        """Number of leading ``keys`` that are cached (the longest cached prefix, in pages)."""
        return sum(1 for _ in takewhile(self._handles.__contains__, keys))

    def lookup(self, keys: Sequence[int]) -> np.ndarray:
        """Handles of the longest cached prefix of ``keys``."""
        n = self.match(keys)
        return np.fromiter(map(self._handles.__getitem__, keys[:n]), dtype=np.int64, count=n)

    # -- updates -----------------------------------------------------------------------
    def add(self, key: int, tier: int, slot: int, checksum: int, depth: int = 0, node: int = 0) -> int:
        if key in self._handles:
            raise KeyError(f"key {key:#x} is already indexed")
        if self._free_handles:
            handle = self._free_handles.pop()
            self._keys[handle] = key
        else:
            handle = len(self._keys)
            self._keys.append(key)
            if handle >= len(self._cols["tier"]):
                self._grow()
        self._handles[key] = handle
        cols = self._cols
        cols["tier"][handle] = tier
        cols["slot"][handle] = slot
        cols["node"][handle] = node
        cols["checksum"][handle] = checksum
        cols["pins"][handle] = 0
        cols["hits"][handle] = 0
        cols["depth"][handle] = depth
        self.clock += 1
        cols["last_access"][handle] = self.clock
        return handle

    def _grow(self) -> None:
        for name, col in self._cols.items():
            bigger = np.zeros(len(col) * 2, dtype=col.dtype)
            bigger[: len(col)] = col
            self._cols[name] = bigger

    def remove(self, handle: int) -> int:
        """Drop an entry; returns its key. Pinned entries cannot be removed."""
        if self._cols["pins"][handle] > 0:
            raise ValueError(f"page {self.key_of(handle):#x} is pinned")
        key = self.key_of(handle)
        del self._handles[key]
        self._keys[handle] = None
        self._free_handles.append(handle)
        return key

    def move(self, handle: int, tier: int, slot: int, node: int | None = None) -> None:
        self._cols["tier"][handle] = tier
        self._cols["slot"][handle] = slot
        if node is not None:
            self._cols["node"][handle] = node

    def pin(self, handles: np.ndarray) -> None:
        np.add.at(self._cols["pins"], handles, 1)

    def unpin(self, handles: np.ndarray) -> None:
        pins = self._cols["pins"]
        np.subtract.at(pins, handles, 1)
        if (pins[handles] < 0).any():
            raise ValueError("unpin without a matching pin")

    def touch(self, handles: np.ndarray) -> None:
        """Record a hit: bump heat and recency (deeper pages get older stamps)."""
        n = len(handles)
        if n == 0:
            return
        self._cols["hits"][handles] += 1
        self._cols["last_access"][handles] = self.clock + np.arange(n, 0, -1)
        self.clock += n

    def memory_bytes(self) -> int:
        """Approximate bytes used: hash map, key and handle objects, handle list and columns."""
        keys = sum(sys.getsizeof(k) + sys.getsizeof(h) for k, h in self._handles.items())
        columns = sum(col.itemsize for col in self._cols.values()) * len(self._keys)
        return sys.getsizeof(self._handles) + keys + sys.getsizeof(self._keys) + columns
