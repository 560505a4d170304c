"""A request's disk pages are read from the page cache on the caller's thread and from the
device concurrently: the same bytes as one by one either way, and a corrupt page still ends
the prefix, is dropped, and is never delivered."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.core.tiers import DiskPool
from kvray.core.tiers.disk import CACHED_BATCH_BYTES, HEADER_BYTES, READERS
from tests.conftest import TINY, prefix_kv

PAGES = 3 * READERS  # more pages than readers, so reads queue behind each other


def _evict(pool: DiskPool) -> None:
    """Drop the pool file's pages from the page cache, as the LMCache benchmark's cold rows do."""
    os.fdatasync(pool._fd)
    os.posix_fadvise(pool._fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("where", ["page cache", "evicted", "readers only"])
def test_read_many_returns_what_read_into_returns(tmp_path, monkeypatch, where):
    """``readers only``: every page reported absent from the page cache, so all of them
    take the concurrent path whatever the file system keeps cached."""
    pool = DiskPool(tmp_path, PAGES, 4096, fingerprint=b"f" * 16)
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, (PAGES, 4096), dtype=np.uint8)
    digests = [pool.write_runs(slot, slot + 1, None, [pages[slot, :1000], pages[slot, 1000:]]) for slot in range(PAGES)]
    concurrent = np.zeros_like(pages)
    one_by_one = np.zeros_like(pages)
    order = list(rng.permutation(PAGES))
    if where == "evicted":
        _evict(pool)
    elif where == "readers only":
        monkeypatch.setattr(pool, "_read_cached", lambda slot, chunks: None)
    got = list(pool.read_many([(int(slot), [concurrent[slot, :3000], concurrent[slot, 3000:]]) for slot in order]))
    for (stored, digest), slot in zip(got, order):
        assert stored is not None and stored.slot == slot and digest == digests[slot]
        assert pool.read_runs(int(slot), [one_by_one[slot]]) == (stored, digest)
    assert np.array_equal(concurrent, pages) and np.array_equal(one_by_one, pages)
    if where != "evicted":  # whether an eviction took is the kernel's call: either path is right then
        assert (pool._readers is not None) == (where == "readers only")  # page-cache hits stay on this thread
    pool.close()


def test_read_many_reads_a_torn_slot_as_torn_on_either_path(tmp_path, monkeypatch):
    pool = DiskPool(tmp_path, 4, 4096, fingerprint=b"f" * 16)
    page = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    for slot in range(3):
        pool.write_runs(slot, slot + 1, None, [page])
    pool.free(1)  # its magic cleared: no valid header
    want = [(0, True), (1, False), (2, True), (3, False)]  # slot 3 lies past the end of the file
    for cached in (True, False):
        if not cached:
            monkeypatch.setattr(pool, "_read_cached", lambda slot, chunks: None)
        out = np.zeros((4, 4096), dtype=np.uint8)
        got = list(pool.read_many([(slot, [out[slot]]) for slot, _ in want]))
        assert [stored is not None for stored, _ in got] == [ok for _, ok in want]
        assert np.array_equal(out[0], page) and np.array_equal(out[2], page)
    pool.close()


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("bad", [0, 1, READERS, PAGES - 1])
def test_a_corrupt_page_ends_the_prefix_among_concurrent_reads(tmp_path, monkeypatch, bad, cold):
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=PAGES), disk_dir=tmp_path / "disk"))
    tokens = list(range(PAGES * TINY.page_tokens))
    store.store(tokens, prefix_kv(TINY, tokens))
    handle = store.manager.index.handle_of(store.keys(tokens)[bad])
    disk = store.pools[2]
    offset = int(store.manager.index.slot[handle]) * disk.stride + HEADER_BYTES
    (path,) = Path(tmp_path / "disk").iterdir()
    with open(path, "r+b") as fh:
        fh.seek(offset + 7)
        byte = fh.read(1)
        fh.seek(offset + 7)
        fh.write(bytes([byte[0] ^ 0x01]))
    if cold:
        monkeypatch.setattr(disk, "_read_cached", lambda slot, chunks: None)
    hit = store.load(tokens)
    good = bad * TINY.page_tokens
    assert hit.tokens == good and torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, :good])
    assert store.stats()["corrupt_pages"] == 1 and store.lookup(tokens) == good
    again = store.load(tokens)  # the pages after the dropped one are unreachable, not wrong
    assert again.tokens == good and store.stats()["corrupt_pages"] == 1
    store.close()


def test_short_writes_and_reads_are_finished(tmp_path, monkeypatch):
    """The kernel may move fewer bytes than asked (a signal, a resource limit); a page is
    then finished from where the call stopped, never left partly written or read. Short
    calls cannot be provoked on a local file here, so the two syscalls are wrapped at that
    boundary to move at most 1,000 bytes each (the real calls do the moving)."""
    pool = DiskPool(tmp_path, 2, 8192, fingerprint=b"f" * 16)
    page = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8)
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def short_pwritev(fd, buffers, offset, *flags):
        first = memoryview(buffers[0]).cast("B")[:1000]
        return real_pwritev(fd, [first], offset, *flags)

    def short_preadv(fd, buffers, offset, *flags):
        first = memoryview(buffers[0]).cast("B")[:1000]
        return real_preadv(fd, [first], offset, *flags)

    monkeypatch.setattr(os, "pwritev", short_pwritev)
    digest = pool.write_runs(0, 1, None, [page[:5000], page[5000:]])
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    monkeypatch.setattr(os, "preadv", short_preadv)
    cached, cold = np.zeros_like(page), np.zeros_like(page)
    ((stored, got),) = pool.read_many([(0, [cached[:3000], cached[3000:]])])
    assert stored is not None and got == digest and np.array_equal(cached, page)  # the page-cache path
    assert pool.read_runs(0, [cold]) == (stored, digest) and np.array_equal(cold, page)  # the device path
    pool.close()


@pytest.mark.parametrize("page_nbytes", [4096, 3 * CACHED_BATCH_BYTES + 4096], ids=["one batch", "several batches"])
def test_the_checksum_is_the_whole_pages_xxh3_however_it_is_batched(tmp_path, page_nbytes):
    """The slot file's format: the header's checksum is xxh3-64 of the page's bytes, so
    files written with any batch size (or by an earlier kvray) verify the same way."""
    pool = DiskPool(tmp_path, 2, page_nbytes, fingerprint=b"f" * 16)
    page = np.random.default_rng(2).integers(0, 256, page_nbytes, dtype=np.uint8)
    cut = page_nbytes // 3
    digest = pool.write_runs(0, 1, None, [page[:cut], page[cut:]])
    assert digest == xxhash.xxh3_64_intdigest(page)
    assert pool.scan()[0].checksum == digest
    out = np.zeros_like(page)
    ((stored, got),) = pool.read_many([(0, [out[:100], out[100:]])])
    assert got == digest and np.array_equal(out, page)
    pool.close()
