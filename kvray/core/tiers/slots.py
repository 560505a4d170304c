"""Slot accounting of a fixed-size page pool.

Slots are handed out lowest-first from a heap so that occupied slots stay packed at the
front of the pool; that keeps the free space in long runs (low fragmentation), which is
what lets a pool hand a request several adjacent slots and lets disk segments stay short.
"""

from __future__ import annotations

import heapq

import numpy as np


class SlotAllocator:
    """Free list of ``capacity`` page slots.

    Example::

        slots = SlotAllocator(4)
        a = slots.alloc()          # 0
        slots.free(a)
        slots.occupancy            # 0.0
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity))
        self._used = bytearray(capacity)  # 1 per used slot: scalar reads and writes, once per page event

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 1.0

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])

    def alloc(self) -> int | None:
        """Lowest free slot, or None when the pool is full."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used[slot] = 1
        return slot

    @classmethod
    def with_used(cls, capacity: int, used: list[int]) -> SlotAllocator:
        """An allocator whose ``used`` slots are taken (pages a disk pool found on restart)."""
        slots = cls(capacity)
        used_mask = np.zeros(capacity, dtype=bool)
        used_mask[used] = True
        slots._used = bytearray(used_mask.tobytes())
        slots._free = np.flatnonzero(~used_mask).tolist()
        return slots

    def free(self, slot: int) -> None:
        if not self._used[slot]:
            raise ValueError(f"slot {slot} is not in use")
        self._used[slot] = 0
        heapq.heappush(self._free, slot)

    def fragmentation(self) -> float:
        """1 - (longest run of free slots / free slots): 0 when all free space is one run."""
        free = len(self._free)
        if free == 0:
            return 0.0
        padded = np.concatenate(([True], np.frombuffer(self._used, dtype=bool), [True]))
        edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
        longest = int((edges[1::2] - edges[::2]).max())
        return 1.0 - longest / free
