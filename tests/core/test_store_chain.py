"""One chain writer: the PageStore, the simulator and the training environment all store
through ``CacheManager.store_chain``, so the same requests under the same policy leave the
same index behind (which pages, in which tier and slot, under which parent, how hot)."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.errors import StorageError
from kvray.core.index import ROOT
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy
from kvray.core.store import PageStore
from kvray.core.tiers import Tier
from kvray.policy import make_policy
from kvray.rl.env import PlacementEnv
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import Simulator
from kvray.traces import TraceRequest
from tests.conftest import TINY
from tests.properties import examples

SCENARIO = load_scenario(DEFAULT_SCENARIO)
SIZES = TierSizes(device=2, host=3, disk=4)  # tight: storing demotes and drops
CAPACITIES = {Tier.DEVICE: SIZES.device, Tier.HOST: SIZES.host, Tier.DISK: SIZES.disk}

# Requests are paths in a small tree of blocks, so they share prefixes; a page's key
# names its whole prefix, as trace ids and kvray's page keys do.
paths = st.lists(st.integers(0, 2), min_size=1, max_size=7)
workloads = st.lists(paths, min_size=1, max_size=25)


def chain(path: list[int]) -> list[int]:
    return [hash(tuple(path[: i + 1])) & (2**62 - 1) for i in range(len(path))]


def trace_of(workload: list[list[int]]) -> list[TraceRequest]:
    tokens = SCENARIO.layout.page_tokens
    return [TraceRequest(float(i), len(p) * tokens, 1, tuple(chain(p))) for i, p in enumerate(workload)]


def index_state(manager: CacheManager) -> dict[int, tuple]:
    index = manager.index
    state = {}
    for key in index.keys():
        h = index.handle_of(key)
        parent = int(index.parent[h])
        state[key] = (
            int(index.tier[h]),
            int(index.slot[h]),
            None if parent == ROOT else index.key_of(parent),
            int(index.depth[h]),
            int(index.hits[h]),
            int(index.last_access[h]),
        )
    return state


def simulated(workload: list[list[int]], policy: str) -> dict[int, tuple]:
    sim = Simulator(SCENARIO, make_policy(policy), CAPACITIES)
    sim.replay(trace_of(workload))
    return index_state(sim.manager)


def stored(workload: list[list[int]], policy: str) -> dict[int, tuple]:
    """Each request served as an engine does: count the hit on its cached prefix, store the rest."""
    with tempfile.TemporaryDirectory() as disk:
        store = PageStore(StoreConfig(layout=TINY, tiers=SIZES, disk_dir=disk), make_policy(policy))
        try:
            for path in workload:
                keys = chain(path)
                store.touch_pages(keys)
                pages = np.zeros((len(keys), TINY.page_nbytes), dtype=np.uint8)
                store.put_pages(keys, pages, store.fingerprint.digest)
            return index_state(store.manager)
        finally:
            store.close()


def trained(workload: list[list[int]]) -> dict[int, tuple]:
    """The training environment, its agent always following the first expert (LRU)."""
    env = PlacementEnv(trace_of(workload), SCENARIO, CAPACITIES, episode_windows=len(workload))
    env.warmup_requests = 0
    env.reset(seed=0)
    terminated = False
    while not terminated:
        terminated = env.step(0)[2]
    return index_state(env.sim.manager)


@settings(max_examples=examples(30), deadline=None)
@given(workloads)
def test_store_simulator_and_env_leave_the_same_index(workload):
    expected = simulated(workload, "lru")
    assert stored(workload, "lru") == expected
    assert trained(workload) == expected


@pytest.mark.parametrize("policy", ["lfu", "arc", "threshold", "s3fifo", "sieve"])
@settings(max_examples=examples(15), deadline=None)
@given(workload=workloads)
def test_store_and_simulator_agree_under_other_policies(policy, workload):
    assert stored(workload, policy) == simulated(workload, policy)


def test_a_failed_write_gives_its_slot_back_and_keeps_the_chain_before_it():
    manager = CacheManager({Tier.HOST: 4}, LRUPolicy())

    def write(depth: int, key: int, tier: Tier, slot: int, parent: int) -> int:
        if depth == 2:
            raise StorageError("disk full")
        return 7

    with pytest.raises(StorageError):
        manager.store_chain([1, 2, 3, 4], lambda *move: None, write)
    assert sorted(manager.index.keys()) == [1, 2] and manager.slots[Tier.HOST].used == 2
    assert manager.index.checksum[manager.index.handle_of(2)] == 7
    assert manager.store_chain([1, 2, 3, 4], lambda *move: None) == 2  # the stored prefix is skipped
