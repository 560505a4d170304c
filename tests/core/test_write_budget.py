"""The NVMe write budget (kvray/core/write_budget.py): a store writes at most its budget to
disk, whether pages enter the disk tier new or demoted from host memory, and every page it
then holds reads back exact; what the budget refused is a miss, never a torn page."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.errors import ConfigError
from kvray.core.store import PageStore
from kvray.core.write_budget import BURST_S, WriteBudget, checked_rate
from tests.conftest import TINY

PAGE = TINY.page_nbytes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chain(store: PageStore, seed: int, pages: int) -> tuple[list[int], np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 30_000, pages * TINY.page_tokens, dtype=np.int32)
    return store.keys(tokens), np.random.default_rng(seed + 1).integers(0, 256, (pages, PAGE), dtype=np.uint8)


def take(budget: WriteBudget) -> bool:
    """Ask, and pay for the page when allowed (as the manager does around a disk write)."""
    if not budget.allows():
        return False
    budget.pay()
    return True


def test_the_bucket_never_lets_more_than_its_rate_and_one_burst_through():
    clock = Clock()
    budget = WriteBudget(bytes_per_s=4 * PAGE, page_nbytes=PAGE, clock=clock)
    taken = 0
    for step in range(200):
        clock.now = step * 0.013
        taken += sum(take(budget) for _ in range(3))
        assert taken * PAGE <= 4 * PAGE * (clock.now + BURST_S)
    assert budget.taken_bytes == taken * PAGE and budget.refused_pages == 600 - taken
    assert taken >= 4 * clock.now  # and it does let the rate through
    budget.set_rate(PAGE)  # a lower rate: the bucket shrinks to its new burst
    clock.now += 10
    assert sum(take(budget) for _ in range(10)) == math.floor(BURST_S)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "fast", True])
def test_a_budget_that_is_not_a_positive_rate_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match="disk write budget"):
        checked_rate(bad)


def test_new_pages_past_the_budget_are_not_stored_and_the_rest_read_back_exact(tmp_path):
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=64), disk_dir=tmp_path))
    clock = Clock()
    store.manager.set_disk_budget(3 * PAGE / BURST_S, clock)  # a burst of three pages
    keys, pages = chain(store, 0, 8)
    assert store.put_pages(keys, pages, store.fingerprint.digest) == 3  # the chain stops where the budget does
    clock.now += BURST_S * 2 / 3  # two pages' worth later
    assert store.put_pages(keys, pages, store.fingerprint.digest) == 2
    found, got = store.get_pages(keys)
    assert found == keys[:5] and np.array_equal(got, pages[:5])
    assert store.stats()["disk_write_budget"]["refused_pages"] == 2 and store.manager.disk_budget.taken_bytes == 5 * PAGE
    store.set_disk_write_budget(None)  # no budget: the rest goes in
    assert store.put_pages(keys, pages, store.fingerprint.digest) == 3
    assert np.array_equal(store.get_pages(keys)[1], pages)
    store.close()


def test_demotions_past_the_budget_drop_pages_and_what_stays_reads_back_exact(tmp_path):
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=4, disk=64), disk_dir=tmp_path))
    clock = Clock()
    store.manager.set_disk_budget(2 * PAGE / BURST_S, clock)
    for seed in range(4):  # 16 pages through a 4-page host tier: 12 demotions asked for, 2 paid
        keys, pages = chain(store, 10 * seed, 4)
        assert store.put_pages(keys, pages, store.fingerprint.digest) == 4
    tiers = store.stats()["tiers"]
    assert tiers["disk"]["used"] == 2 and tiers["host"]["used"] == 4  # the others, refused, were dropped (with their chains)
    assert store.manager.disk_budget.taken_bytes == 2 * PAGE and store.manager.disk_budget.refused_pages > 0
    served = 0
    for seed in range(4):
        keys, pages = chain(store, 10 * seed, 4)
        found, got = store.get_pages(keys)
        assert np.array_equal(got, pages[: len(found)])  # every page served is the one written
        served += len(found)
    assert served > 0
    store.close()
