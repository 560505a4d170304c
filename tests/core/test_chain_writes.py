"""A durable store (``disk_fsync``) writes a chain's disk pages concurrently and publishes
them in order.

The policy's decisions stay in chain order (kvray/core/chain_writes.py): each page is
admitted and given a slot in turn, the disk pages written on two threads while the next
ones are placed, and every write has returned (its checksum in the index, a chain cut
before a failed write) before any reader sees the chain. The writes are made to block here
so the test sees two of them overlap, sees a reader wait while an earlier page is still
being written, and sees what a failed write leaves: the pages before it, in the index and
on disk after a restart; nothing after.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.errors import StorageError
from kvray.core.store import PageStore
from kvray.core.tiers import Tier
from tests.conftest import TINY

PAGES = 8
WAIT_S = 10.0


def disk_store(directory) -> PageStore:
    return PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=64), disk_dir=directory, disk_fsync=True))


def chain(store: PageStore, seed: int = 0) -> tuple[list[int], np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 30_000, PAGES * TINY.page_tokens, dtype=np.int32)
    pages = np.random.default_rng(seed + 1).integers(0, 256, (PAGES, TINY.page_nbytes), dtype=np.uint8)
    return store.keys(tokens), pages


def wrap_writes(store: PageStore, before_write) -> None:
    """Call ``before_write(key)`` in the writing thread before each disk page is written."""
    pool = store.pools[Tier.DISK]
    write = pool.write

    def hooked(slot, key, parent_key, page):
        before_write(key)
        return write(slot, key, parent_key, page)

    pool.write = hooked


def test_two_disk_pages_are_written_at_once_and_read_back_exact(tmp_path):
    store = disk_store(tmp_path / "disk")
    keys, pages = chain(store)
    both = threading.Barrier(2, timeout=WAIT_S)  # broken (an error) unless two writes are in flight together
    threads = set()

    def meet(key):
        threads.add(threading.current_thread().name)
        if key in keys[:2]:
            both.wait()

    wrap_writes(store, meet)
    assert store.put_pages(keys, pages, store.fingerprint.digest) == PAGES
    assert len(threads) == 2 and all(name.startswith("kvray-disk-write") for name in threads)
    found, got = store.get_pages(keys)
    assert found == keys and np.array_equal(got, pages)
    store.close()


def test_no_reader_sees_a_chain_before_every_page_of_it_is_written(tmp_path):
    store = disk_store(tmp_path / "disk")
    keys, pages = chain(store)
    first_may_go, later_written = threading.Event(), threading.Event()

    def hold_the_first(key):
        if key == keys[0]:
            assert first_may_go.wait(WAIT_S)
        elif key == keys[-1]:
            later_written.set()

    wrap_writes(store, hold_the_first)
    stored, seen = [], []
    storing = threading.Thread(target=lambda: stored.append(store.put_pages(keys, pages, store.fingerprint.digest)))
    storing.start()
    assert later_written.wait(WAIT_S)  # the last page is written while the first is not
    reading = threading.Thread(target=lambda: seen.append(store.get_pages(keys)))
    reading.start()
    reading.join(0.5)
    assert reading.is_alive() and not seen  # the reader waits: nothing is published yet
    first_may_go.set()
    storing.join(WAIT_S)
    reading.join(WAIT_S)
    assert stored == [PAGES]
    found, got = seen[0]
    assert found == keys and np.array_equal(got, pages)  # every page, verified against its checksum
    store.close()


def test_a_failed_write_keeps_the_pages_before_it_and_gives_back_the_rest(tmp_path):
    store = disk_store(tmp_path / "disk")
    keys, pages = chain(store)

    def fail_the_fourth(key):
        if key == keys[3]:
            raise StorageError("disk tier: injected write failure")

    wrap_writes(store, fail_the_fourth)
    with pytest.raises(StorageError, match="injected"):
        store.put_pages(keys, pages, store.fingerprint.digest)
    assert store.match(keys) == 3 and len(store) == 3
    assert store.stats()["tiers"]["disk"]["used"] == 3  # the slots of pages 4.. (written or not) went back
    store.close()
    again = disk_store(tmp_path / "disk")  # a restart finds exactly the published pages
    found, got = again.get_pages(keys)
    assert found == keys[:3] and np.array_equal(got, pages[:3]) and len(again) == 3
    again.close()
