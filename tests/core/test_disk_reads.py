"""A request's disk pages are read concurrently: same bytes as one by one, and a corrupt
page still ends the prefix, is dropped, and is never delivered."""

from pathlib import Path

import numpy as np
import pytest
import torch

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.core.tiers import DiskPool
from kvray.core.tiers.disk import HEADER_BYTES, READERS
from tests.conftest import TINY, prefix_kv

PAGES = 3 * READERS  # more pages than readers, so reads queue behind each other


def test_read_many_returns_what_read_into_returns(tmp_path):
    pool = DiskPool(tmp_path, PAGES, 4096, fingerprint=b"f" * 16)
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, (PAGES, 4096), dtype=np.uint8)
    digests = [pool.write_runs(slot, slot + 1, None, [pages[slot, :1000], pages[slot, 1000:]]) for slot in range(PAGES)]
    concurrent = np.zeros_like(pages)
    one_by_one = np.zeros_like(pages)
    order = list(rng.permutation(PAGES))
    got = list(pool.read_many([(int(slot), [concurrent[slot, :3000], concurrent[slot, 3000:]]) for slot in order]))
    for (stored, digest), slot in zip(got, order):
        assert stored is not None and stored.slot == slot and digest == digests[slot]
        assert pool.read_runs(int(slot), [one_by_one[slot]]) == (stored, digest)
    assert np.array_equal(concurrent, pages) and np.array_equal(one_by_one, pages)
    pool.close()


@pytest.mark.parametrize("bad", [0, 1, READERS, PAGES - 1])
def test_a_corrupt_page_ends_the_prefix_among_concurrent_reads(tmp_path, bad):
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
    hit = store.load(tokens)
    good = bad * TINY.page_tokens
    assert hit.tokens == good and torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, :good])
    assert store.stats()["corrupt_pages"] == 1 and store.lookup(tokens) == good
    again = store.load(tokens)  # the pages after the dropped one are unreachable, not wrong
    assert again.tokens == good and store.stats()["corrupt_pages"] == 1
    store.close()
