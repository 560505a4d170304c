"""Prefix index: which pages exist, where each lives, who is reading it.

Because page keys chain over the whole prefix (:mod:`kvray.core.keys`), a page's key names its
parent, and the index keeps one invariant: a page is cached only while its parent is
(the cached set is *prefix-closed*, a tree). A page whose parent is gone could never be
matched again, so dropping a page drops its descendants too. The invariant turns the
longest-prefix question into a binary search over the request's keys: ~8 hash probes for
a 256-page request instead of 256, which is what the scheduler asks on every step. Entries are kept
column-wise (numpy arrays indexed by a small integer *handle*) so that an index of
millions of pages costs about a hundred bytes per page and so that a whole request's
tiers, slots and pins are read or updated in one vectorised step.

Pins protect pages being read or moved: a pinned page is never evicted or moved. Every
``pin`` is matched by an ``unpin``; the counts are per page, so concurrent readers stack.

Example::
    from kvray.core.index import ROOT, PrefixIndex
    from kvray.core.tiers import Tier

    index = PrefixIndex()
    first = index.add(key=42, tier=Tier.HOST, slot=3, checksum=0xABC, parent=ROOT)
    assert index.match([42, 43]) == 1            # only the first key is cached
    index.add(key=43, tier=Tier.DISK, slot=0, checksum=0xDEF, parent=first)
    assert index.match([42, 43]) == 2
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from kvray.core.errors import RequestError

ROOT = -1  # the parent handle of a request's first page
NONE = -1  # no child / no sibling
UNTRACKED = -1  # a tier or slot this index does not keep
Item = TypeVar("Item")

_COLUMNS: dict[str, np.dtype] = {
    "tier": np.dtype(np.int8),
    "slot": np.dtype(np.int32),
    "node": np.dtype(np.int32),
    "checksum": np.dtype(np.uint64),
    "pins": np.dtype(np.int32),
    "hits": np.dtype(np.int32),
    "last_access": np.dtype(np.int64),
    "depth": np.dtype(np.int32),
    "parent": np.dtype(np.int32),
    "first_child": np.dtype(np.int32),  # children form a doubly linked sibling list
    "next_sibling": np.dtype(np.int32),
    "prev_sibling": np.dtype(np.int32),
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

    @property
    def parent(self) -> np.ndarray:
        return self._cols["parent"]

    @property
    def first_child(self) -> np.ndarray:
        """Each page's first child (NONE: a leaf), read whole by the reuse policy's pool in C."""
        return self._cols["first_child"]

    def has_children(self, handles: Sequence[int] | np.ndarray) -> np.ndarray:
        return self._cols["first_child"][np.asarray(handles, dtype=np.int64)] != NONE

    def is_leaf(self, handle: int) -> bool:
        """No cached page below ``handle``: one scalar read, where eviction asks per victim."""
        return self._cols["first_child"].item(handle) == NONE

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
        """Number of leading ``keys`` that are cached (the longest cached prefix, in pages).

        Binary search: valid because the cached set is prefix-closed and ``keys`` chain.
        """
        present = self._handles.__contains__
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if present(keys[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def lookup(self, keys: Sequence[int]) -> np.ndarray:
        """Handles of the longest cached prefix of ``keys``. Keys that do not chain (a page
        cached below one that is not: not one request's prefix) are refused by name, not
        answered with another chain's pages or a bare ``KeyError``."""
        n = self.match(keys)
        try:
            return np.fromiter(map(self._handles.__getitem__, keys[:n]), dtype=np.int64, count=n)
        except KeyError:
            gap = next(i for i, key in enumerate(keys[:n]) if key not in self._handles)
            later = next(i for i in range(n - 1, gap, -1) if keys[i] in self._handles)
            raise RequestError(
                f"keys do not chain: key #{later} ({keys[later]:#x}) is cached but key #{gap} ({keys[gap]:#x}) "
                "before it is not; each key must name its whole prefix (kvray.core.keys.page_keys)"
            ) from None

    # -- updates -----------------------------------------------------------------------
    def add(
        self,
        key: int,
        tier: int = UNTRACKED,
        slot: int = UNTRACKED,
        checksum: int = 0,
        *,
        parent: int,
        depth: int = 0,
        node: int = 0,
    ) -> int:
        """Index a page whose parent (handle, or :data:`ROOT`) is already indexed.

        An index of locations only (the Ray controller's: which node holds a page) leaves
        ``tier`` and ``slot`` UNTRACKED; the node's own store keeps those.
        """
        if key in self._handles:
            raise KeyError(f"key {key:#x} is already indexed")
        if parent != ROOT and self._keys[parent] is None:
            raise KeyError(f"parent handle {parent} is not in the index")
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
        cols["tier"][handle] = int(tier)  # an IntEnum costs numpy a slow protocol probe
        cols["slot"][handle] = slot
        cols["node"][handle] = node
        cols["checksum"][handle] = checksum
        cols["pins"][handle] = 0
        cols["hits"][handle] = 0
        cols["depth"][handle] = depth
        cols["parent"][handle] = parent
        cols["first_child"][handle] = NONE
        cols["prev_sibling"][handle] = NONE
        cols["next_sibling"][handle] = NONE
        if parent != ROOT:
            first = cols["first_child"].item(parent)
            cols["next_sibling"][handle] = first
            if first != NONE:
                cols["prev_sibling"][first] = handle
            cols["first_child"][parent] = handle
        self.clock += 1
        cols["last_access"][handle] = self.clock
        return handle

    def _grow(self) -> None:
        for name, col in self._cols.items():
            bigger = np.zeros(len(col) * 2, dtype=col.dtype)
            bigger[: len(col)] = col
            self._cols[name] = bigger

    def remove(self, handle: int) -> int:
        """Drop a leaf entry; returns its key. Pinned entries and parents cannot be removed."""
        cols = self._cols  # scalar reads by .item(): a Python int, not a numpy scalar (once per eviction)
        if cols["pins"].item(handle) > 0:
            raise ValueError(f"page {self.key_of(handle):#x} is pinned")
        if cols["first_child"].item(handle) != NONE:
            raise ValueError(f"page {self.key_of(handle):#x} still has cached children")
        key = self.key_of(handle)
        prev, nxt = cols["prev_sibling"].item(handle), cols["next_sibling"].item(handle)
        if prev != NONE:
            cols["next_sibling"][prev] = nxt
        else:
            parent = cols["parent"].item(handle)
            if parent != ROOT:
                cols["first_child"][parent] = nxt
        if nxt != NONE:
            cols["prev_sibling"][nxt] = prev
        del self._handles[key]
        self._keys[handle] = None
        self._free_handles.append(handle)
        return key

    def subtree(self, handles: Sequence[int]) -> list[int]:
        """``handles`` and all their cached descendants, children before parents."""
        first, nxt = self._cols["first_child"], self._cols["next_sibling"]
        order: list[int] = []
        stack = [int(h) for h in handles]
        while stack:
            handle = stack.pop()
            order.append(handle)
            child = first[handle]
            while child != NONE:
                stack.append(int(child))
                child = nxt[child]
        return list(dict.fromkeys(reversed(order)))  # a handle reached twice keeps its deeper place

    def remove_subtree(self, handle: int) -> list[int]:
        """Drop ``handle`` and its descendants (they can never match without it), children
        first; returns their handles, free for reuse now. Raises ValueError, removing
        nothing, if one of them is pinned."""
        doomed = self.subtree([handle])
        if (self._cols["pins"][doomed] > 0).any():
            raise ValueError(f"page {self.key_of(handle):#x} or a descendant is pinned")
        for h in doomed:
            self.remove(h)
        return doomed

    def move(self, handle: int, tier: int, slot: int, node: int | None = None) -> None:
        self._cols["tier"][handle] = int(tier)
        self._cols["slot"][handle] = slot
        if node is not None:
            self._cols["node"][handle] = node

    def pin(self, handles: np.ndarray) -> None:
        """Pin distinct ``handles`` (a request's pages are distinct: their keys chain)."""
        self._cols["pins"][handles] += 1

    def unpin(self, handles: np.ndarray) -> None:
        pins = self._cols["pins"]
        if (pins[handles] <= 0).any():
            raise ValueError("unpin without a matching pin")
        pins[handles] -= 1

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


def parents_first(links: Iterable[tuple[int, int | None, Item]]) -> tuple[list[tuple[int, int | None, Item]], list[Item]]:
    """Order ``(key, parent key or None, item)`` links so each parent comes before its
    children, as :meth:`PrefixIndex.add` needs to rebuild a prefix-closed index (a disk
    tier after a restart, a controller from its stores); items whose chain does not reach a
    root come back apart as orphans: they could never be matched.
    """
    children: dict[int | None, list[tuple[int, int | None, Item]]] = defaultdict(list)
    for link in links:
        children[link[1]].append(link)
    ordered: list[tuple[int, int | None, Item]] = []
    stack = children.pop(None, [])
    while stack:
        link = stack.pop()
        ordered.append(link)
        stack.extend(children.pop(link[0], []))
    return ordered, [item for orphans in children.values() for _, _, item in orphans]
