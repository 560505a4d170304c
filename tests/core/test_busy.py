"""A store measures how busy its drive has been and tells a policy that asks, as the simulator
tells it from its links: ``BusyShare`` counts time in flight once per window, the disk pool
times its read and write calls (not its page-cache copies), and ``reuse`` on a real store
stops writing pages to a drive whose reads keep it busy (its disk rule: docs/sim-eval/README.md,
"A disk hit slower than recomputing")."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvray.core.busy import BusyShare
from kvray.core.config import StoreConfig, TierSizes
from kvray.core.placement import LRUPolicy, RequestInfo
from kvray.core.store import PageStore
from kvray.core.tiers import DiskPool, Tier
from tests.conftest import TINY, prefix_kv


def test_busy_share_counts_time_in_flight_once_and_forgets_what_left_the_window():
    busy = BusyShare(window_s=1.0)
    assert busy.share(now=5.0) == 0.0
    busy.add(10.0, 10.3)
    busy.add(10.2, 10.6)  # overlapping (another thread): 10.0-10.6 in flight
    assert busy.share(now=10.7) == pytest.approx(0.6)
    assert busy.share(now=11.35) == pytest.approx(0.25)  # 10.35-10.6 is still in the window
    assert busy.share(now=11.7) == 0.0
    for i in range(10_000):  # bounded without anyone asking: what left the window is dropped
        busy.add(20.0 + i * 0.01, 20.0 + i * 0.01 + 0.005)
    assert len(busy._spans) <= 101
    assert busy.share(now=20.0 + 9_999 * 0.01 + 0.005) == pytest.approx(0.5, abs=0.01)
    with pytest.raises(ValueError, match="window_s"):
        BusyShare(window_s=0.0)


def _union(spans: list[tuple[float, float]], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in spans if min(e, hi) > max(s, lo)):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


@given(
    st.lists(st.tuples(st.floats(0, 5), st.floats(0, 0.5)), max_size=40),
    st.lists(st.floats(0, 8), min_size=1, max_size=10),
    st.floats(0.1, 2.0),
)
def test_busy_share_is_the_time_in_flight_inside_the_window(ops, asks, window):
    """Told each operation as it ends: share x window is the measure of the union of the
    spans told, clipped to the window."""
    ended = sorted(((start, start + length) for start, length in ops), key=lambda span: span[1])
    busy = BusyShare(window_s=window)
    told = 0
    for now in sorted(asks):
        while told < len(ended) and ended[told][1] <= now:
            busy.add(*ended[told])
            told += 1
        assert busy.share(now=now) * window == pytest.approx(_union(ended[:told], now - window, now), abs=1e-9)


@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 0.5)), max_size=40), st.randoms(use_true_random=False))
def test_operations_told_out_of_order_count_their_union_and_no_gap(ops, rng):
    """Threads tell their calls a little out of order: the gaps between calls never count."""
    spans = [(start, start + length) for start, length in ops]
    rng.shuffle(spans)
    busy = BusyShare(window_s=10.0)  # longer than every span's distance: nothing is forgotten
    for span in spans:
        busy.add(*span)
    assert busy.share(now=6.0) * 10.0 == pytest.approx(_union(spans, -4.0, 6.0), abs=1e-9)


def test_the_disk_pool_times_its_read_and_write_calls_not_its_page_cache_copies(tmp_path, monkeypatch):
    pool = DiskPool(tmp_path, 4, 4096, fingerprint=b"f" * 16)
    page = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    assert pool.writes.share() == pool.reads.share() == 0.0
    digests = [pool.write_runs(slot, slot + 1, None, [page]) for slot in range(4)]
    assert pool.writes.share() > 0.0 and pool.reads.share() == 0.0
    out = np.zeros(4096, dtype=np.uint8)
    assert pool.read_into(0, out, digests[0])  # one page: a preadv
    assert pool.reads.share() > 0.0
    pool.reads = BusyShare()
    assert all(stored is not None for stored, _ in pool.read_many([(1, [out]), (2, [out])]))
    if pool._readers is None:  # served from the page cache on this thread (the kernel's call): no drive time
        assert pool.reads.share() == 0.0
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
    index, pool = store.manager.index, store.pools[Tier.DISK]
    handle = next(h for h in map(index.handle_of, index.keys()) if index.tier[h] == Tier.DISK)
    assert pool.read_into(int(index.slot[handle]), np.empty(TINY.page_nbytes, np.uint8), int(index.checksum[handle]))
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
    pages to it; once its reads kept it busy 0.9 of the time (a load would wait 3
    prefills) it drops what leaves host instead, and every page still cached loads as stored.
    The busy time is told to the pool's measurement directly, over a minute's window: this
    machine's page cache serves a drive's reads too fast to keep it that busy on cue (the
    timing of real reads is the test above)."""
    from kvray.policy.reuse import ReusePolicy

    policy = ReusePolicy.load()
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=2, disk=8), disk_dir=tmp_path), policy)
    costs = {Tier.HOST: 0.05, Tier.DISK: 0.3}
    index, disk = store.manager.index, store.pools[Tier.DISK]

    def on_disk() -> list[int]:
        return sorted(h for h in map(index.handle_of, index.keys()) if index.tier[h] == Tier.DISK)

    first = list(range(4 * TINY.page_tokens))
    store.on_request(RequestInfo(keys=tuple(store.keys(first)), tier_cost=costs))
    store.store(first, prefix_kv(TINY, first))
    written = on_disk()
    assert len(written) == 2 and policy.stats()["disk_closed_requests"] == 0
    disk.reads = BusyShare(window_s=60.0)  # a minute's window: 0.9 busy for several seconds, however slow this machine
    now = time.monotonic()
    disk.reads.add(now - 54.0, now)
    second = list(range(10_000, 10_000 + 4 * TINY.page_tokens))
    store.on_request(RequestInfo(keys=tuple(store.keys(second)), tier_cost=costs))
    store.store(second, prefix_kv(TINY, second))
    assert policy.stats()["disk_closed_requests"] == 1
    assert on_disk() == written  # nothing more written; what was there stays
    assert store.load(first).tokens > 0
    for tokens in (first, second):
        got = store.load(tokens)
        if got.tokens:
            assert torch.equal(got.kv, prefix_kv(TINY, tokens)[:, :, : got.tokens])
