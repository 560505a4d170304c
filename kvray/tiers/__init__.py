"""Tiers: where page bytes live.

Each tier is a pool of fixed-size page slots. :class:`SlotAllocator` is the accounting
(free list, occupancy, fragmentation) that the simulator shares with the runtime; the
pools (:class:`HostPool`, :class:`DevicePool`, :class:`DiskPool`) hold the bytes.
"""

from enum import IntEnum


class Tier(IntEnum):
    """Tiers from fastest to slowest; a lower value is closer to the engine."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    REMOTE = 3

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {t: t.name.lower() for t in Tier}  # enum's ``name`` is a slow descriptor; labels are hot
LOCAL_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)

from kvray.tiers.slots import SlotAllocator  # noqa: E402
from kvray.tiers.memory import DevicePool, HostPool  # noqa: E402
from kvray.tiers.disk import DiskPool, StoredPage  # noqa: E402

__all__ = ["DevicePool", "DiskPool", "HostPool", "LOCAL_TIERS", "SlotAllocator", "StoredPage", "Tier"]
