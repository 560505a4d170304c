"""Memory pools are resident from creation: a fresh process's first store pays no page faults."""

import os

import numpy as np
import pytest

from kvray.core.tiers import DevicePool, HostPool

POOL_BYTES = 32 << 20


def resident_bytes(array: np.ndarray) -> int:
    """Rss of the mapping holding ``array``, from /proc/self/smaps (what the kernel has faulted in)."""
    address = array.ctypes.data
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("pool mapping not found in /proc/self/smaps")


@pytest.mark.parametrize("shared", [False, True])
def test_host_pool_is_resident_before_any_store(shared):
    name = f"kvray-test-pool-{os.getpid()}" if shared else None
    pool = HostPool(POOL_BYTES // 4096, 4096, shared_name=name)
    try:
        assert resident_bytes(pool.view(0)) >= POOL_BYTES
    finally:
        pool.close()


def test_attached_host_pool_reads_the_creators_bytes():
    """Faulting in a created segment keeps it zeroed; an attacher sees what the owner wrote."""
    name = f"kvray-test-attach-{os.getpid()}"
    owner = HostPool(4, 4096, shared_name=name)
    try:
        assert not owner.view(3).any()
        owner.view(3)[:] = 9
        reader = HostPool(4, 4096, shared_name=name, attach=True)
        assert (reader.view(3) == 9).all()
        reader.close()
    finally:
        owner.close()


def test_device_stand_in_is_resident_before_any_store():
    pool = DevicePool(POOL_BYTES // 4096, 4096, device="cpu")
    assert pool.stand_in
    assert resident_bytes(pool.view(0)) >= POOL_BYTES
    pool.close()
