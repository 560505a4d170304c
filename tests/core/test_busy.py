"""A store measures how busy its drive has been and tells a policy that asks, as the simulator
tells it from its links: ``BusyShare`` counts what the simulator's link window counts, the disk
pool times its reads and writes, and ``reuse`` on a real store stops writing pages to a drive
whose reads keep it busy (its disk rule: docs/sim-eval/README.md, "A disk hit slower than
recomputing")."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvray.core.busy import BusyShare
from kvray.core.config import StoreConfig, TierSizes
from kvray.core.pages import PageLayout
from kvray.core.placement import LRUPolicy, RequestInfo
from kvray.core.store import PageStore
from kvray.core.tiers import DiskPool, Tier
from tests.conftest import TINY, prefix_kv

BIG = PageLayout(
    layers=4, kv_heads=8, head_dim=128, page_tokens=64, dtype="float32"
)  # 2 MiB pages: a read outlasts the loop around it


def test_busy_share_counts_the_operations_that_ended_in_the_window():
    busy = BusyShare(window_s=1.0)
    assert busy.share(now=5.0) == 0.0
    busy.add(10.0, 10.3)
    busy.add(10.2, 10.6)  # overlapping (another thread): both count
    assert busy.share(now=10.7) == pytest.approx(0.7)
    assert busy.share(now=11.35) == pytest.approx(0.4)  # the first ended 1.05 s ago
    assert busy.share(now=11.7) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        BusyShare(window_s=0.0)


@given(
    st.lists(st.tuples(st.floats(0, 5), st.floats(0, 0.5)), max_size=40),
    st.lists(st.floats(0, 8), min_size=1, max_size=10),
    st.floats(0.1, 2.0),
)
def test_busy_share_is_the_durations_ended_in_the_window_over_it(ops, asks, window):
    """Against the definition, for operations told in the order they ended and ``now`` never
    going backwards."""
    ended = sorted((start + length, length) for start, length in ops)
    asks = sorted(asks)
    busy = BusyShare(window_s=window)
    told = 0
    for now in asks:
        while told < len(ended) and ended[told][0] <= now:
            end, length = ended[told]
            busy.add(end - length, end)
            told += 1
        want = sum(length for end, length in ended[:told] if now - window < end <= now) / window
        assert busy.share(now=now) == pytest.approx(want, abs=1e-9)


def test_the_disk_pool_times_its_reads_on_every_path_and_its_writes(tmp_path, monkeypatch):
    pool = DiskPool(tmp_path, 4, 4096, fingerprint=b"f" * 16)
    page = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    assert pool.writes.share() == pool.reads.share() == 0.0
    digests = [pool.write_runs(slot, slot + 1, None, [page]) for slot in range(4)]
    assert pool.writes.share() > 0.0 and pool.reads.share() == 0.0
    out = np.zeros(4096, dtype=np.uint8)
    reads = [
        lambda: pool.read_into(0, out, digests[0]),  # the device path, one page
        lambda: list(pool.read_many([(1, [out]), (2, [out])])),  # the page cache, on this thread
    ]
    for read in reads:
        pool.reads = BusyShare()
        read()
        assert pool.reads.share() > 0.0
    monkeypatch.setattr(pool, "_read_cached", lambda slot, chunks: None)  # the readers, two slots in one read
    pool.reads = BusyShare()
    assert all(stored is not None for stored, _ in pool.read_many([(2, [np.zeros(4096, np.uint8)]), (3, [out])]))
    assert pool.reads.share() > 0.0
    assert pool.reads.share(now=time.monotonic() + 2.0) == 0.0  # a second later the drive is idle again
    pool.close()


class Told(LRUPolicy):
    """LRU that keeps what each request told it."""

    def __init__(self, link: bool, disk: bool) -> None:
        super().__init__()
        self.needs_link_util, self.needs_disk_util = link, disk
        self.told: list[RequestInfo] = []

    def on_request(self, info: RequestInfo) -> None:
        self.told.append(info)


@pytest.mark.parametrize("link,disk", [(True, False), (False, True), (False, False)])
def test_a_store_tells_its_drives_busy_shares_only_to_a_policy_that_asks(tmp_path, link, disk):
    policy = Told(link, disk)
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=2, disk=8), disk_dir=tmp_path), policy)
    tokens = list(range(6 * TINY.page_tokens))
    store.store(tokens, prefix_kv(TINY, tokens))  # four pages reach disk
    store.load(tokens)  # and are read back from it
    store.on_request(RequestInfo(keys=(1,), load_util={Tier.HOST: 0.25}))
    (info,) = policy.told
    if link:
        assert info.load_util[Tier.HOST] == 0.25 and info.load_util[Tier.DISK] > 0.0
    else:
        assert info.load_util == {Tier.HOST: 0.25}
    assert (info.disk_write_util > 0.0) == disk
    driveless = Told(True, True)
    PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=2)), driveless).on_request(RequestInfo(keys=(1,)))
    assert driveless.told[0].load_util is None and driveless.told[0].disk_write_util == 0.0


def test_reuse_on_a_store_stops_writing_to_a_drive_its_reads_keep_busy(tmp_path):
    """A disk load costs 0.3 of a prefill here: while the drive is idle ``reuse`` demotes host
    pages to it; after a second of back-to-back reads (busy ~0.9: a load would wait 3 prefills)
    it drops what leaves host instead, and every page still cached loads as stored."""
    from kvray.policy.reuse import ReusePolicy

    policy = ReusePolicy.load()
    store = PageStore(StoreConfig(layout=BIG, tiers=TierSizes(host=2, disk=8), disk_dir=tmp_path), policy)
    costs = {Tier.HOST: 0.05, Tier.DISK: 0.3}
    index, disk = store.manager.index, store.pools[Tier.DISK]

    def on_disk() -> list[int]:
        return sorted(h for h in map(index.handle_of, index.keys()) if index.tier[h] == Tier.DISK)

    first = list(range(4 * BIG.page_tokens))
    store.on_request(RequestInfo(keys=tuple(store.keys(first)), tier_cost=costs))
    store.store(first, prefix_kv(BIG, first))
    written = on_disk()
    assert len(written) == 2 and policy.stats()["disk_closed_requests"] == 0
    page = np.empty(BIG.page_nbytes, dtype=np.uint8)
    handle = written[0]
    until = time.monotonic() + 1.05
    while time.monotonic() < until:
        assert disk.read_into(int(index.slot[handle]), page, int(index.checksum[handle]))
    assert disk.reads.share() > 0.5
    second = list(range(10_000, 10_000 + 4 * BIG.page_tokens))
    store.on_request(RequestInfo(keys=tuple(store.keys(second)), tier_cost=costs))
    store.store(second, prefix_kv(BIG, second))
    assert policy.stats()["disk_closed_requests"] == 1
    assert on_disk() == written  # nothing more written; what was there stays
    for tokens in (first, second):
        got = store.load(tokens)
        if got.tokens:
            assert torch.equal(got.kv, prefix_kv(BIG, tokens)[:, :, : got.tokens])
