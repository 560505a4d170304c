"""Slot pools against a plain set model: allocation, occupancy, fragmentation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.tiers import DevicePool, DiskPool, HostPool, Pool, SlotAllocator
from kvray.core.tiers.memory import PAGE_ALIGN
from tests.properties import examples


def longest_free_run(capacity, used):
    best = run = 0
    for slot in range(capacity):
        run = 0 if slot in used else run + 1
        best = max(best, run)
    return best


@settings(max_examples=examples(200), deadline=None)
@given(capacity=st.integers(0, 24), ops=st.lists(st.integers(-1, 30), max_size=80))
def test_allocator_matches_set_model(capacity, ops):
    slots = SlotAllocator(capacity)
    used: set[int] = set()
    for op in ops:
        if op < 0 or op >= capacity:  # allocate
            slot = slots.alloc()
            free = sorted(set(range(capacity)) - used)
            assert slot == (free[0] if free else None)
            if slot is not None:
                used.add(slot)
        elif op in used:
            slots.free(op)
            used.remove(op)
        assert slots.used == len(used)
        assert slots.occupancy == (len(used) / capacity if capacity else 1.0)
        free_count = capacity - len(used)
        expected = 0.0 if free_count == 0 else 1 - longest_free_run(capacity, used) / free_count
        assert abs(slots.fragmentation() - expected) < 1e-12


def test_with_used_restores_taken_slots():
    slots = SlotAllocator.with_used(5, [0, 3])
    assert [slots.alloc() for _ in range(4)] == [1, 2, 4, None]


@given(capacity=st.integers(1, 9), page_nbytes=st.sampled_from([1, 64, 4096, 12_288, 1 << 16]))
@settings(max_examples=examples(25), deadline=None)
def test_host_pool_slots_are_page_aligned_and_disjoint(capacity, page_nbytes):
    """Slot 0 starts on a 4 KiB boundary (copies from torch tensors stay at memcpy speed),
    and writing one slot never touches another."""
    pool = HostPool(capacity, page_nbytes)
    assert pool.view(0).ctypes.data % PAGE_ALIGN == 0
    for slot in range(capacity):
        pool.view(slot)[:] = slot
    for slot in range(capacity):
        assert pool.view(slot).shape == (page_nbytes,)
        assert (pool.view(slot) == slot).all()


@pytest.mark.parametrize("kind", ["host", "device", "disk", "host+checksum"])
def test_every_pool_speaks_the_pool_protocol_and_refuses_corrupt_bytes(kind, tmp_path):
    """write / read_into / view / free round-trip a page the same way for every pool, and a
    verifying pool (disk always, memory with checksums) refuses bytes that changed."""
    page_nbytes = 4096
    pools = {
        "host": lambda: HostPool(4, page_nbytes),
        "device": lambda: DevicePool(4, page_nbytes, device="cpu"),
        "disk": lambda: DiskPool(tmp_path, 4, page_nbytes, fingerprint=b"f" * 16),
        "host+checksum": lambda: HostPool(4, page_nbytes, checksum=True),
    }
    pool: Pool = pools[kind]()
    page = np.random.default_rng(1).integers(0, 256, page_nbytes, dtype=np.uint8)
    digest = pool.write(2, 0xABC, None, page)
    out = np.zeros_like(page)
    assert pool.read_into(2, out, digest) and np.array_equal(out, page)
    verifies = kind in ("disk", "host+checksum")
    assert pool.read_into(2, out, digest ^ 1) is not verifies  # a wrong expectation fails only where checked
    view = pool.view(2)
    assert (view is None) == (kind == "disk")
    if view is not None:
        view[0] ^= 0xFF
        assert pool.read_into(2, out, digest) is not verifies
    pool.free(2)
    if kind == "disk":
        assert not pool.read_into(2, out, digest)  # a freed disk slot never reads back
    pool.close()
