"""Tiers: where page bytes live.

Each tier is a pool of fixed-size page slots. :class:`SlotAllocator` is the accounting
(free list, occupancy, fragmentation) that the simulator shares with the runtime; the
pools (:class:`HostPool`, :class:`DevicePool`, :class:`DiskPool`) hold the bytes and all
speak :class:`Pool`, so the store never asks which kind it holds and a new kind of pool
(a peer's memory, say) plugs in the same way.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

import numpy as np


class Tier(IntEnum):
    """Tiers from fastest to slowest; a lower value is closer to the engine."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    REMOTE = 3

    # The int's own hash (a tier equals its value anyway): Enum's hashes the member's name
    # in Python, and tiers key the manager's, the policies' and the simulator's dicts at
    # every page event (a third of a dict lookup's cost went to it).
    __hash__ = int.__hash__

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {t: t.name.lower() for t in Tier}  # enum's ``name`` is a slow descriptor; labels are hot


LOCAL_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
TIER_LABELS = tuple(t.label for t in Tier)  # indexed by Tier value: what reports and scenarios call a tier
TIER_BY_LABEL = {t.label: t for t in Tier}


class Pool(Protocol):
    """Fixed-size page slots of one tier; what the store writes, reads and frees.

    ``write`` copies a page view (see :func:`kvray.core.pages.request_page`) into a slot
    and returns the checksum the page now carries; ``read_into`` copies a slot into a
    page view and says whether the bytes verify against ``expected``. ``view`` is the slot
    itself where it is addressable memory (moves then copy from it directly), else None.
    """

    capacity: int
    kind: str
    stand_in: bool

    def view(self, slot: int) -> np.ndarray | None: ...

    def write(self, slot: int, key: int, parent_key: int | None, page: np.ndarray) -> int: ...

    def read_into(self, slot: int, page: np.ndarray, expected: int) -> bool: ...

    def free(self, slot: int) -> None: ...

    def close(self) -> None: ...


from kvray.core.tiers.disk import DiskPool, StoredPage  # noqa: E402
from kvray.core.tiers.memory import HostPool  # noqa: E402
from kvray.core.tiers.slots import SlotAllocator  # noqa: E402
from kvray.lazy import lazy_attributes  # noqa: E402

if TYPE_CHECKING:  # what type checkers and IDEs see
    from kvray.core.tiers.device import DevicePool

# DevicePool loads torch: imported on first use, so a process without an accelerator tier (a
# store actor on a CPU node, a controller, the simulator) starts without it (kvray.lazy)
__getattr__ = lazy_attributes(__name__, {"DevicePool": "kvray.core.tiers.device"})

__all__ = [
    "LOCAL_TIERS", "TIER_BY_LABEL", "TIER_LABELS", "DevicePool", "DiskPool", "HostPool", "Pool",
    "SlotAllocator", "StoredPage", "Tier",
]  # fmt: skip
