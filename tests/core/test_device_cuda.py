"""The device tier on a real CUDA device: pages through pinned staging rows and asynchronous
copies come back byte-exact, in order, and demote to host and disk intact.

These need a GPU and skip without one (``make gpu-check`` runs them where there is one);
the CPU stand-in's accounting and copy paths are covered by the other core tests.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.core.tiers import DevicePool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=64, page_tokens=16, dtype="bfloat16")


def test_pool_uses_cuda_with_pinned_staging_rows():
    pool = DevicePool(4, 4096)
    assert pool.device.type == "cuda" and not pool.stand_in
    assert pool._staging.is_pinned() and pool._staging.shape == (DevicePool.STAGING_PAGES, 4096)
    pool.close()


def test_more_queued_writes_than_staging_rows_each_land_intact():
    """Writes return once queued; a staging row is reused only after its copy ran, so pages
    written back to back (more than there are rows) all land with their own bytes."""
    pages = 4 * DevicePool.STAGING_PAGES + 1
    pool = DevicePool(pages, 8192)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (pages, 8192), dtype=np.uint8)
    for slot in range(pages):
        pool.write(slot, slot, None, data[slot])
    out = np.empty(8192, dtype=np.uint8)
    for slot in range(pages):
        assert pool.read_into(slot, out, expected=0)
        assert np.array_equal(out, data[slot]), f"slot {slot}"
    pool.close()


def test_reads_on_several_threads_beside_writes_each_get_their_own_page():
    """A store copies pinned pages out outside its lock: reads run at once on several threads,
    and beside writes, through the same staging rows, and each must return its slot's page."""
    slots, readers, rounds = 16, 6, 200
    pool = DevicePool(slots + 1, 8192)
    data = np.random.default_rng(1).integers(0, 256, (slots + 1, 8192), dtype=np.uint8)
    for slot in range(slots):
        pool.write(slot, slot, None, data[slot])
    wrong: list[int] = []

    def read(seed: int) -> None:
        out, rng = np.empty(8192, dtype=np.uint8), np.random.default_rng(seed)
        for _ in range(rounds):
            slot = int(rng.integers(slots))
            pool.read_into(slot, out, expected=0)
            if not np.array_equal(out, data[slot]):
                wrong.append(slot)

    def write() -> None:  # another slot rewritten all along: its rows pass through the same staging rows
        for _ in range(rounds):
            pool.write(slots, slots, None, data[slots])

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(readers)] + [threading.Thread(target=write)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pool.close()
    assert not wrong, f"{len(wrong)} reads returned another slot's bytes"


def test_rewritten_slot_reads_the_last_write():
    pool = DevicePool(1, 4096)
    out = np.empty(4096, dtype=np.uint8)
    for value in range(10):
        pool.write(0, value, None, np.full(4096, value, dtype=np.uint8))
    assert pool.read_into(0, out, expected=0) and (out == 9).all()
    assert (pool.view(0).cpu().numpy() == 9).all()  # view() waits for queued copies
    pool.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_store_round_trips_and_demotes_device_pages_byte_exact(tmp_path, checksum):
    """A request larger than the device tier: pages move device -> host -> disk (two-phase
    moves read the device through the staging rows) and every page loads back exact."""
    pages = 12
    config = StoreConfig(
        layout=LAYOUT,
        tiers=TierSizes(device=3, host=3, disk=16),
        disk_dir=tmp_path / "kv",
        checksum_memory=checksum,
    )
    store = PageStore(config)
    tokens = np.arange(pages * LAYOUT.page_tokens, dtype=np.int32)
    kv = torch.randn(LAYOUT.request_shape(len(tokens))).to(torch.bfloat16)
    assert store.store(tokens, kv) == pages
    occupancy = store.stats()["tiers"]
    assert occupancy["device"]["used"] == 3 and occupancy["disk"]["used"] >= 1
    hit = store.load(tokens)
    assert hit.tokens == len(tokens) and torch.equal(hit.kv, kv)
    store.close()
